"""When a failed connection is taken for ours (egress down) rather than the receiver's: pure policy."""

from streams.webhooks.egress import EgressWatch


def test_one_receiver_that_cannot_be_reached_is_its_own_failure():
    watch = EgressWatch(hosts=3, window_s=300)
    assert [watch.unreachable("down.example:443", t) for t in (0, 10, 20, 30)] == [False] * 4


def test_three_receivers_unreachable_and_none_answering_is_ours_until_one_answers():
    watch = EgressWatch(hosts=3, window_s=300)
    assert [watch.unreachable(r, t) for t, r in enumerate(["a:443", "b:443", "c:443", "a:443", "d:443"])] == \
        [False, False, True, True, True]
    watch.answered()
    assert [watch.unreachable(r, 10 + t) for t, r in enumerate(["a:443", "b:443"])] == [False, False]


def test_an_answer_in_between_keeps_failures_the_receivers():
    """Broken receivers among working ones: each answer starts the count again."""
    watch = EgressWatch(hosts=3, window_s=300)
    seen = []
    for t, r in enumerate(["a:443", "b:443", "c:443", "d:443"] * 3):
        seen.append(watch.unreachable(r, t))
        if t % 2:
            watch.answered()
    assert seen == [False] * 12


def test_failures_older_than_the_window_are_forgotten():
    watch = EgressWatch(hosts=3, window_s=300)
    assert watch.unreachable("a:443", 0) is False
    assert watch.unreachable("b:443", 200) is False
    assert watch.unreachable("c:443", 301) is False  # a's failure is 301 s old
    assert watch.failing == 2
    assert watch.unreachable("d:443", 302) is True
