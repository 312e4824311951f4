"""Which retry partitions the retrier stops reading while it holds too much. Pure code.

The retrier holds every message it read until the message is due. Past its bound (`max_held`
messages or `max_held_bytes`) it must stop reading something, and what it stops reading must not be
what is due soon: one tenant's backlog parked for hours on the long tiers must not stop another
tenant's 10 s retries. So past the bound it pauses only the partitions that hold a message due
later than NEAR_MS from now (they free memory only then); partitions whose held messages are all due
sooner keep flowing, as they release what they read within minutes. At twice the bound (counting
messages due late up to the bound only: those past it, what their partitions handed over in the step
that reached the bound, pause only their own partitions, so a long tier's backlog read at full speed
after a restart never stops the short tiers) the partitions holding more than an even share of the
bound are paused (and those holding messages due late, as below twice the bound): copies are keyed
by tenant, so one tenant's parked backlog of large sends, due within minutes, sits in a few
partitions, and must not stop every other tenant's 10 s retries (they were dead-lettered too old).
The others are read on while what they hold, with the writer's unacknowledged copies, stays under
the bound: at most three times `max_*` in all, plus a fetch. Otherwise (no partition past its share,
or the rest at the bound: a lane that cannot be written) every partition is paused, as a plain bound
would.
At or below half the bound everything is read again.
"""

from __future__ import annotations

from dataclasses import dataclass

Partition = tuple[str, int]

# Copies on the 10s, 1m, 5m and 15m tiers are due within 15 minutes, plus 20% jitter: their
# partitions keep flowing when the bound is reached because of longer waits.
NEAR_MS = 18 * 60 * 1000


@dataclass
class PartitionLoad:
    """The messages of one partition held, their bytes, and the latest due time among them (a partition's
    messages leave in due order, so that one is held while any of them is)."""

    count: int = 0
    size: int = 0
    latest_due_ms: float = 0.0


def far_loads(loads: dict[Partition, PartitionLoad], now_ms: float) -> dict[Partition, PartitionLoad]:
    """The partitions holding a message due later than NEAR_MS from now, with what each holds."""
    return {partition: load for partition, load in loads.items() if load.latest_due_ms > now_ms + NEAR_MS}


@dataclass(frozen=True)
class MemoryBound:
    max_held: int
    max_bytes: int

    def full(self, count: int, size: int, far: dict[Partition, PartitionLoad]) -> bool:
        """`count` messages of `size` bytes held, those of `far` counted up to the bound only, reach twice the
        bound: nothing more may be read."""
        far_count, far_size = sum(load.count for load in far.values()), sum(load.size for load in far.values())
        return (count - far_count + min(far_count, self.max_held) >= 2 * self.max_held
                or size - far_size + min(far_size, self.max_bytes) >= 2 * self.max_bytes)

    def paused(self, count: int, size: int, assigned: set[Partition], paused: set[Partition],
               far: dict[Partition, PartitionLoad], loads: dict[Partition, PartitionLoad]) -> set[Partition]:
        """The partitions to pause, holding `count` messages of `size` bytes with `paused` paused now; `loads`:
        what each partition holds; `far`: those of them holding a message due later than NEAR_MS."""
        if self.full(count, size, far):
            over = self.over_share(assigned, loads)
            rest_count = count - sum(loads[p].count for p in over)  # the writer's unacknowledged copies included
            rest_size = size - sum(loads[p].size for p in over)
            if over and rest_count < self.max_held and rest_size < self.max_bytes:
                return over | (set(far) & assigned)
            return set(assigned)
        if count <= self.max_held // 2 and size <= self.max_bytes // 2:
            return set()
        if not paused and count < self.max_held and size < self.max_bytes:
            return set()  # not reached yet
        return set(far) & assigned  # reached, and until half is released: only what is due late waits

    def over_share(self, assigned: set[Partition], loads: dict[Partition, PartitionLoad]) -> set[Partition]:
        """The assigned partitions holding more than an even share of the bound (in messages or bytes)."""
        n = max(1, len(assigned))
        return {p for p in assigned if (load := loads.get(p)) is not None
                and (load.count * n > self.max_held or load.size * n > self.max_bytes)}
