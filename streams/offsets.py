"""Per-partition offset tracking for out-of-order completion. Pure code.

Messages of one partition finish out of order (tenants wait on their own buckets), but Kafka stores
one offset per partition. The offset to store is the lowest offset not yet finished: everything
below it is done, so a restart re-reads only work that may be unfinished (idempotency absorbs the
finished messages above it that are read again).
"""

from __future__ import annotations

import heapq


class PartitionOffsets:
    def __init__(self) -> None:
        self._pending: list[int] = []     # min-heap of unfinished offsets
        self._finished: set[int] = set()  # finished offsets still above the lowest unfinished
        self._highest = -1                # highest offset seen

    def add(self, offset: int) -> None:
        heapq.heappush(self._pending, offset)
        self._highest = max(self._highest, offset)

    def finish(self, offset: int) -> int | None:
        """Mark an offset finished; returns the new committable offset when it advanced."""
        self._finished.add(offset)
        advanced = None
        while self._pending and self._pending[0] in self._finished:
            self._finished.discard(heapq.heappop(self._pending))
            advanced = True
        if advanced:
            return self.committable()
        return None

    def committable(self) -> int | None:
        """The next offset to consume from after a restart (Kafka's commit convention)."""
        if self._pending:
            return self._pending[0]
        return self._highest + 1 if self._highest >= 0 else None

    def __len__(self) -> int:
        return len(self._pending)


class OffsetTracker:
    """PartitionOffsets for every (topic, partition) this consumer owns."""

    def __init__(self) -> None:
        self._parts: dict[tuple[str, int], PartitionOffsets] = {}

    def add(self, topic: str, partition: int, offset: int) -> None:
        self._parts.setdefault((topic, partition), PartitionOffsets()).add(offset)

    def finish(self, topic: str, partition: int, offset: int) -> int | None:
        part = self._parts.get((topic, partition))
        return part.finish(offset) if part else None  # None: partition revoked meanwhile

    def committable(self) -> dict[tuple[str, int], int]:
        return {tp: off for tp, p in self._parts.items() if (off := p.committable()) is not None}

    def idle(self, topic: str, partition: int) -> bool:
        """Nothing of this partition is unfinished."""
        part = self._parts.get((topic, partition))
        return part is None or len(part) == 0

    def forget(self, topic: str, partition: int) -> None:
        self._parts.pop((topic, partition), None)

    def in_flight(self) -> int:
        return sum(len(p) for p in self._parts.values())
