"""The retry tiers' watch reads how overdue a tier is from the lowest message its retrier has not released (the
committed position's). No broker: a fake peeker returns a partition's messages from the position assigned."""

import time
from types import SimpleNamespace

from streams.lag.retry_watch import RetryTierWatch
from streams.names import TopicNames


class Peeker:
    def __init__(self, partitions: dict[int, list[int]]):
        self.partitions = partitions  # partition -> due_at_ms of its messages, by offset
        self.assigned: list = []

    def assign(self, tps):
        self.assigned = [(tp.partition, tp.offset) for tp in tps]

    def consume(self, num_messages=1, timeout=0):
        out = []
        for partition, offset in self.assigned:
            for o, due in enumerate(self.partitions[partition][offset:], start=offset):
                out.append(SimpleNamespace(error=lambda: None, partition=lambda p=partition: p,
                                           offset=lambda o=o: o, headers=lambda d=due: [("due_at_ms", str(d).encode())]))
        self.assigned = []
        return out

    def unassign(self):
        pass


def _overdue(partitions: dict[int, list[int]], positions: dict[int, tuple[int, int]]) -> float:
    watch = RetryTierWatch("127.0.0.1:9", TopicNames(), ("email",))
    return watch._overdue(Peeker(partitions), "notif.email.marketing.retry.1h", positions)  # type: ignore[arg-type]


def test_a_copy_released_before_the_head_of_its_partition_is_not_overdue():
    """On the 1 h tier a copy due in 72 minutes (the head: the retrier holds it, and the committed offset waits for
    it) followed by one due 48 minutes after it was written, released on time: the second is behind the
    committed offset, but it was released. Read as overdue, it paged RetryTierStuck for the 24 minutes between."""
    now = int(time.time() * 1000)
    assert _overdue({0: [0, 0, now + 20 * 60_000, now - 5 * 60_000]}, {0: (2, 4)}) == 0.0


def test_the_head_past_its_due_time_is_overdue():
    now = int(time.time() * 1000)
    overdue = _overdue({0: [now - 90_000, now - 200_000], 1: [now + 1_000]}, {0: (0, 2), 1: (0, 1)})
    assert 89 <= overdue <= 92
