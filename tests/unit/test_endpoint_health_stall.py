"""When the endpoint-health app reads a partition again (`streams.health.stall`)."""

from streams.health.stall import StallWatch


def test_a_partition_behind_at_the_same_offset_twice_while_the_agent_is_idle_is_read_again_once():
    watch = StallWatch()
    assert watch.observe(taken=10, busy=False, behind={0: 9}) == {}
    assert watch.observe(taken=10, busy=False, behind={0: 9, 3: 4}) == {0: 9}
    assert watch.observe(taken=10, busy=False, behind={0: 9, 3: 4}) == {3: 4}
    # still at 9 after reading it again (e.g. only a transaction marker past it): not again from 9
    assert watch.observe(taken=10, busy=False, behind={0: 9}) == {}
    assert watch.observe(taken=10, busy=False, behind={0: 9}) == {}
    watch.observe(taken=10, busy=False, behind={0: 12})
    assert watch.observe(taken=10, busy=False, behind={0: 12}) == {0: 12}  # a new offset: once more


def test_an_agent_that_took_an_event_or_holds_one_is_not_stalled():
    watch = StallWatch()
    watch.observe(taken=10, busy=False, behind={0: 9})
    assert watch.observe(taken=11, busy=False, behind={0: 9}) == {}   # it is reading: the commit will follow
    assert watch.observe(taken=11, busy=True, behind={0: 9}) == {}    # e.g. waiting for the broker to ack an alert
    assert watch.observe(taken=11, busy=False, behind={0: 9}) == {0: 9}


def test_a_committed_offset_that_moved_or_a_partition_caught_up_is_not_stalled():
    watch = StallWatch()
    watch.observe(taken=3, busy=False, behind={0: 9, 1: 2})
    assert watch.observe(taken=3, busy=False, behind={0: 10}) == {}  # 0 moved on, 1 caught up
    assert watch.observe(taken=3, busy=False, behind={0: 10, 1: 2}) == {0: 10}  # 1 is seen once again


def test_forget_starts_over():
    watch = StallWatch()
    watch.observe(taken=3, busy=False, behind={0: 9})
    watch.forget()
    assert watch.observe(taken=3, busy=False, behind={0: 9}) == {}
    assert watch.observe(taken=3, busy=False, behind={0: 9}) == {0: 9}
