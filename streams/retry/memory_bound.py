"""Which retry partitions the retrier stops reading while it holds too much. Pure code.

The retrier holds every message it read until the message is due. Past its bound (`max_held`
messages or `max_held_bytes`) it must stop reading something, and what it stops reading must not be
what is due soon: one tenant's backlog parked for hours on the long tiers must not stop another
tenant's 10 s retries. So past the bound it pauses only the partitions that hold a message due
later than NEAR_MS from now (they free memory only then); partitions whose held messages are all due
sooner keep flowing, as they release what they read within minutes. Past twice the bound (the near
tiers alone filled it) every partition is paused, as a plain bound would. At or below half the
bound everything is read again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

Partition = tuple[str, int]

# Copies on the 10s, 1m, 5m and 15m tiers are due within 15 minutes, plus 20% jitter: their
# partitions keep flowing when the bound is reached because of longer waits.
NEAR_MS = 18 * 60 * 1000


def far_partitions(held: Iterable[tuple[Partition, int]], now_ms: float) -> set[Partition]:
    """The partitions holding a message (partition, due ms) due later than NEAR_MS from now."""
    return {partition for partition, due_ms in held if due_ms > now_ms + NEAR_MS}


@dataclass(frozen=True)
class MemoryBound:
    max_held: int
    max_bytes: int

    def full(self, count: int, size: int) -> bool:
        """Past twice the bound: nothing more may be read."""
        return count >= 2 * self.max_held or size >= 2 * self.max_bytes

    def paused(self, count: int, size: int, assigned: set[Partition], paused: set[Partition],
               far: Callable[[], set[Partition]]) -> set[Partition]:
        """The partitions to pause, holding `count` messages of `size` bytes with `paused` paused
        now; `far()` names the partitions holding a message due later than NEAR_MS (asked only
        when needed: it reads everything held)."""
        if self.full(count, size):
            return set(assigned)
        if count <= self.max_held // 2 and size <= self.max_bytes // 2:
            return set()
        if not paused and count < self.max_held and size < self.max_bytes:
            return set()  # not reached yet
        return far() & assigned  # reached, and until half is released: only what is due late waits
