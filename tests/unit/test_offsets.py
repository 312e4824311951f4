"""Out-of-order completion never stores an offset past unfinished work."""

import random

from streams.offsets import OffsetTracker, PartitionOffsets


def test_offset_advances_only_to_the_lowest_unfinished():
    p = PartitionOffsets()
    for o in (10, 11, 12, 13):
        p.add(o)
    assert p.finish(12) is None            # 10 and 11 still pending
    assert p.committable() == 10
    assert p.finish(10) == 11
    assert p.finish(11) == 13              # 12 was already finished
    assert p.finish(13) == 14


def test_random_completion_order_matches_the_definition():
    rng = random.Random(7)
    p = PartitionOffsets()
    offsets = list(range(100, 300))
    for o in offsets:
        p.add(o)
    order = offsets[:]
    rng.shuffle(order)
    done = set()
    for o in order:
        p.finish(o)
        done.add(o)
        expected = next((x for x in offsets if x not in done), 300)
        assert p.committable() == expected


def test_revoked_partition_is_forgotten():
    t = OffsetTracker()
    t.add("a", 0, 5)
    t.forget("a", 0)
    assert t.finish("a", 0, 5) is None and t.committable() == {}
