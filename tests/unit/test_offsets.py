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


def test_offsets_finished_behind_one_held_for_hours_are_not_kept():
    """A retry copy due in 12 h pins its partition's offset; the copies read after it are released and
    finished meanwhile, and the memory they leave behind must not grow with their number."""
    import tracemalloc

    def held_after(finished: int) -> int:
        p = PartitionOffsets()
        p.add(0)  # due late: unfinished throughout
        tracemalloc.start()
        for o in range(1, finished + 1):
            p.add(o)
            p.finish(o)
        size, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert p.committable() == 0
        return size

    assert held_after(200_000) < 64 * 1024  # kept every finished offset before: megabytes
    p = PartitionOffsets()
    for o in range(0, 1001):
        p.add(o)
    for o in range(1, 1001):
        p.finish(o)
    assert p.finish(0) == 1001


def test_an_offset_read_twice_is_past_once_both_copies_finished_in_any_order():
    p = PartitionOffsets()
    for o in (4, 5, 5):  # 5 read again (a seek back) while its first copy is in flight
        p.add(o)
    assert p.finish(5) is None
    assert p.finish(4) == 5  # the second copy of 5 is unfinished
    assert p.finish(5) == 6
    q = PartitionOffsets()
    for o in (4, 5, 5):
        q.add(o)
    assert q.finish(5) is None and q.finish(5) is None
    assert q.finish(4) == 6  # both copies of 5 finished before 4: stuck at 5 before


def test_an_offset_finished_before_it_is_tracked_changes_nothing():
    p = PartitionOffsets()
    assert p.finish(3) is None and p.committable() is None  # from before a revoke: not this assignment's
    p.add(3)
    assert p.committable() == 3 and len(p) == 1
    assert p.finish(3) == 4
