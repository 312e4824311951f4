"""A table of values with when each was put, for caches keyed by what a long-running process meets (tenants,
hosts): entries past their age are dropped once the table has doubled since it was last pruned, so a table of
every key ever met stays bounded by the live ones, at amortised constant cost. Pure code; time is passed in."""

from __future__ import annotations

from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")
PRUNE_FROM = 1024  # entries below which a table is never pruned


class StampedTable(dict[K, tuple[float, V]], Generic[K, V]):
    """key -> (when put, value)."""

    def __init__(self, max_age_s: float):
        super().__init__()
        self.max_age_s = max_age_s
        self._prune_at = PRUNE_FROM

    def put(self, key: K, value: V, now: float) -> None:
        self[key] = (now, value)
        if len(self) >= self._prune_at:
            for stale in [k for k, (at, _) in self.items() if now - at > self.max_age_s]:
                del self[stale]
            self._prune_at = max(PRUNE_FROM, 2 * len(self))
