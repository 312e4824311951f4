"""When a failed connection is taken for ours (egress down) rather than the receiver's: pure policy."""

from streams.webhooks.egress import EgressWatch


def test_one_tenants_unreachable_receivers_are_its_own_failures_however_many():
    """A tenant's receivers refusing connections (or its name server never answering) never make the failures
    uncounted: it could otherwise hide other tenants' broken receivers from their endpoints' health."""
    watch = EgressWatch(tenants=3, window_s=300)
    assert [watch.unreachable("acme", t) for t in range(10)] == [False] * 10


def test_three_tenants_unreachable_and_none_answering_is_ours_until_one_answers():
    watch = EgressWatch(tenants=3, window_s=300)
    assert [watch.unreachable(tenant, t) for t, tenant in enumerate(["a", "b", "c", "a", "d"])] == \
        [False, False, True, True, True]
    watch.answered()
    assert [watch.unreachable(tenant, 10 + t) for t, tenant in enumerate(["a", "b"])] == [False, False]


def test_an_answer_in_between_keeps_failures_the_receivers():
    """Broken receivers among working ones: each answer starts the count again."""
    watch = EgressWatch(tenants=3, window_s=300)
    seen = []
    for t, tenant in enumerate(["a", "b", "c", "d"] * 3):
        seen.append(watch.unreachable(tenant, t))
        if t % 2:
            watch.answered()
    assert seen == [False] * 12


def test_failures_older_than_the_window_are_forgotten():
    watch = EgressWatch(tenants=3, window_s=300)
    assert watch.unreachable("a", 0) is False
    assert watch.unreachable("b", 200) is False
    assert watch.unreachable("c", 301) is False  # a's failure is 301 s old
    assert watch.unreachable("d", 302) is True  # b, c and d within 300 s
    assert watch.unreachable("b", 602) is False  # c's (301) is too old now
