"""Which retry partitions the retrier stops reading while it holds too much (pure)."""

from streams.retry.memory_bound import NEAR_MS, MemoryBound, PartitionLoad, far_loads

SHORT, LONG, OTHER = ("retry.10s", 0), ("retry.12h", 0), ("retry.1h", 3)
ASSIGNED = {SHORT, LONG, OTHER}
BOUND = MemoryBound(max_held=100, max_bytes=10_000)


def _far(*partitions, count=1):
    return {partition: PartitionLoad(count, count * 10, 0) for partition in partitions}


def test_below_the_bound_nothing_is_paused():
    assert BOUND.paused(99, 9_999, ASSIGNED, set(), _far(LONG), {}) == set()


def test_at_the_bound_only_partitions_holding_messages_due_late_are_paused():
    assert BOUND.paused(100, 0, ASSIGNED, set(), _far(LONG), {}) == {LONG}
    assert BOUND.paused(1, 10_000, ASSIGNED, set(), _far(LONG, OTHER), {}) == {LONG, OTHER}  # bytes count too


def test_until_half_is_released_what_is_due_late_stays_paused_and_the_rest_is_read():
    assert BOUND.paused(60, 0, ASSIGNED, {LONG}, _far(LONG), {}) == {LONG}
    assert BOUND.paused(50, 5_000, ASSIGNED, {LONG}, _far(LONG), {}) == set()


def test_past_twice_the_bound_every_partition_is_paused_then_the_short_tiers_come_back_first():
    assert BOUND.paused(200, 0, ASSIGNED, {LONG}, {}, {}) == ASSIGNED
    assert BOUND.paused(150, 0, ASSIGNED, ASSIGNED, _far(LONG), {}) == {LONG}


def test_past_twice_the_bound_one_tenants_heavy_partition_is_paused_and_the_others_short_retries_flow():
    """Given 600 sends of 1 MiB one tenant had parked, all due within minutes, on one partition (copies are keyed by
    tenant), past twice the byte bound,
    Then only that partition is paused: the others (another tenant's 10 s retries) are read on, up to their share
    of the bound (before: every partition paused until half was released, minutes, and the others' OTPs were
    dead-lettered too old); a load spread evenly still pauses them all."""
    heavy = {SHORT: PartitionLoad(600, 30_000, 0), OTHER: PartitionLoad(1, 10, 0)}
    assert BOUND.paused(601, 30_010, ASSIGNED, set(), {}, heavy) == {SHORT}
    # what is due late stays paused too (it was, below twice the bound)
    assert BOUND.paused(601, 30_010, ASSIGNED, {LONG}, _far(LONG), heavy) == {SHORT, LONG}
    # the rest reaching the bound (copies the lane has not acknowledged: a lane that cannot be written) stops all
    assert BOUND.paused(701, 40_010, ASSIGNED, set(), {}, heavy) == ASSIGNED
    even = {p: PartitionLoad(70, 7_000, 0) for p in ASSIGNED}  # each past its third of the bound
    assert BOUND.paused(210, 21_000, ASSIGNED, set(), {}, even) == ASSIGNED
    assert BOUND.paused(210, 21_000, ASSIGNED, set(), {}, {}) == ASSIGNED  # held by no partition (the writer's)


def test_messages_due_late_count_up_to_the_bound_only():
    assert BOUND.paused(250, 0, ASSIGNED, {LONG}, _far(LONG, count=200), {}) == {LONG}  # 50 due soon + 100
    assert BOUND.paused(300, 0, ASSIGNED, {LONG}, _far(LONG, count=200), {}) == ASSIGNED  # 100 due soon + 100
    assert BOUND.paused(1, 30_000, ASSIGNED, {LONG}, _far(LONG, count=1), {}) == ASSIGNED  # bytes due soon


def test_a_partition_no_longer_assigned_is_not_paused():
    assert BOUND.paused(100, 0, {SHORT}, {LONG}, _far(LONG), {}) == set()


def test_due_late_means_later_than_the_near_tiers_can_be_due():
    now = 1_000_000
    loads = {SHORT: PartitionLoad(1, 1, now + 15 * 60 * 1000 * 1.2), LONG: PartitionLoad(1, 1, now + NEAR_MS + 1),
             OTHER: PartitionLoad(1, 1, now - 5)}
    assert set(far_loads(loads, now)) == {LONG}
