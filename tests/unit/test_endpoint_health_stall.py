"""When the endpoint-health app reads a partition again (`streams.health.stall`)."""

from streams.health.stall import RecoveryWatch, StallWatch


def test_a_partition_behind_at_the_same_offset_twice_while_the_agent_is_idle_is_read_again_once():
    watch = StallWatch()
    assert watch.observe(1, {0: 10}, False, {0: 9}) == {}
    assert watch.observe(1, {0: 10}, False, {0: 9, 3: 4}) == {0: 9}
    watch.reread(0, 9)
    assert watch.observe(1, {0: 10}, False, {0: 9, 3: 4}) == {3: 4}
    watch.reread(3, 4)
    # still at 9 after reading it again (e.g. only a transaction marker past it): not again from 9
    assert watch.observe(1, {0: 10}, False, {0: 9}) == {}
    assert watch.observe(1, {0: 10}, False, {0: 12}) == {}
    assert watch.observe(1, {0: 10}, False, {0: 12}) == {0: 12}  # a new offset: once more


def test_a_read_again_that_was_not_done_is_offered_again():
    watch = StallWatch()
    watch.observe(1, {}, False, {0: 9})
    assert watch.observe(1, {}, False, {0: 9}) == {0: 9}  # e.g. the seek failed: reread() not called
    assert watch.observe(1, {}, False, {0: 9}) == {0: 9}


def test_events_taken_from_other_partitions_do_not_hide_a_stalled_one():
    watch = StallWatch()
    watch.observe(1, {0: 10, 1: 5}, False, {0: 9})
    assert watch.observe(1, {0: 10, 1: 80}, False, {0: 9, 1: 79}) == {0: 9}


def test_a_partition_whose_agent_took_an_event_or_that_was_busy_is_not_stalled():
    watch = StallWatch()
    watch.observe(1, {0: 10}, False, {0: 9})
    assert watch.observe(1, {0: 11}, False, {0: 9}) == {}   # it is reading: the commit will follow
    assert watch.observe(1, {0: 11}, True, {0: 9}) == {}    # e.g. waiting for the broker to ack an alert
    assert watch.observe(1, {0: 11}, False, {0: 9}) == {}   # a busy check does not count as the first
    assert watch.observe(1, {0: 11}, False, {0: 9}) == {0: 9}


def test_a_moved_committed_offset_a_caught_up_partition_or_a_rebalance_starts_over():
    watch = StallWatch()
    watch.observe(1, {}, False, {0: 9, 1: 2})
    assert watch.observe(1, {}, False, {0: 10}) == {}  # 0 moved on, 1 caught up
    assert watch.observe(2, {}, False, {0: 10, 1: 2}) == {}  # a rebalance: seen once in this generation
    assert watch.observe(2, {}, False, {0: 10, 1: 2}) == {0: 10, 1: 2}
    watch.forget()
    assert watch.observe(2, {}, False, {0: 10}) == {}


def test_a_recovery_that_applied_nothing_at_two_checks_though_all_was_fetched_is_read_again():
    """(applied, last offset, position): partition 3 fetched everything and applied nothing, twice."""
    watch = RecoveryWatch()
    assert watch.observe(7, {3: (-1, 4, 5)}) == {}
    assert watch.observe(7, {3: (-1, 4, 5)}) == {3: 0}
    watch.reread(3)
    assert watch.observe(7, {3: (-1, 4, 5)}) == {}  # two more checks before it is read again
    assert watch.observe(7, {3: (-1, 4, 5)}) == {3: 0}
    watch.reread(3)
    assert watch.observe(7, {3: (1, 4, 5)}) == {}
    assert watch.observe(7, {3: (1, 4, 5)}) == {3: 2}  # from the record after the last one applied


def test_a_recovery_still_fetching_or_applying_is_left_alone():
    watch = RecoveryWatch()
    watch.observe(7, {0: (-1, 9, 3), 1: (2, 9, 10)})
    assert watch.observe(7, {0: (-1, 9, 3), 1: (5, 9, 10)}) == {}  # 0 not fetched yet; 1 applied more
    assert watch.observe(7, {0: (-1, 9, 10), 1: (5, 9, 10)}) == {1: 6}  # 0 just fetched: one check only


def test_a_new_generation_or_no_recovery_starts_over():
    watch = RecoveryWatch()
    watch.observe(7, {3: (-1, 4, 5)})
    assert watch.observe(8, {3: (-1, 4, 5)}) == {}
    watch.forget()
    assert watch.observe(8, {3: (-1, 4, 5)}) == {}
    assert watch.observe(8, {3: (-1, 4, 5)}) == {3: 0}
