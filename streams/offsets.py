"""Per-partition offset tracking for out-of-order completion. Pure code.

Messages of one partition finish out of order (tenants wait on their own buckets), but Kafka stores
one offset per partition. The offset to store is the lowest offset not yet finished: everything
below it is done, so a restart re-reads only work that may be unfinished (idempotency absorbs the
finished messages above it that are read again).
"""

from __future__ import annotations

import heapq


class PartitionOffsets:
    """The offsets of one partition not yet finished. Memory follows what is unfinished, not what was
    finished above it: behind one offset held for hours (a retry copy due late) every offset read after
    it finishes, and none of those is kept (a heap entry left behind is dropped when the heap is rebuilt)."""

    def __init__(self) -> None:
        self._open: dict[int, int] = {}  # unfinished offset -> times added and not finished yet (a re-read)
        self._heap: list[int] = []       # min-heap of the open offsets, plus finished ones not dropped yet
        self._highest = -1               # highest offset seen

    def add(self, offset: int) -> None:
        self._open[offset] = self._open.get(offset, 0) + 1
        heapq.heappush(self._heap, offset)
        self._highest = max(self._highest, offset)

    def finish(self, offset: int) -> int | None:
        """Mark an offset finished; returns the new committable offset when it advanced. An offset not
        tracked (from before a revoke, or finished as often as it was added) changes nothing."""
        left = self._open.get(offset)
        if left is None:
            return None
        if left > 1:
            self._open[offset] = left - 1
            return None
        del self._open[offset]
        if offset != self._heap[0]:  # something lower is unfinished: the lowest stays where it was
            if len(self._heap) > 2 * len(self._open) + 64:
                self._heap = list(self._open)
                heapq.heapify(self._heap)
            return None
        while self._heap and self._heap[0] not in self._open:
            heapq.heappop(self._heap)
        return self.committable()

    def committable(self) -> int | None:
        """The next offset to consume from after a restart (Kafka's commit convention)."""
        if self._heap:
            return self._heap[0]
        return self._highest + 1 if self._highest >= 0 else None

    def __len__(self) -> int:
        return len(self._open)


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
        return self.unfinished(topic, partition) == 0

    def unfinished(self, topic: str, partition: int) -> int:
        """Messages of this partition taken and not finished."""
        part = self._parts.get((topic, partition))
        return 0 if part is None else len(part)

    def forget(self, topic: str, partition: int) -> None:
        self._parts.pop((topic, partition), None)

    def in_flight(self) -> int:
        return sum(len(p) for p in self._parts.values())
