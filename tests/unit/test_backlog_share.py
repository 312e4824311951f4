"""A tenant's share of a worker's buffer, and when its excess comes back (pure)."""

from streams.dispatch.backlog import BacklogShare


def test_share_is_a_few_seconds_of_the_tenants_rate_within_bounds():
    b = BacklogShare(horizon_s=5, max_share=5000)
    assert b.share(rate=5, per_request=5) == 25
    assert b.share(rate=1, per_request=100) == 100       # at least one full request
    assert b.share(rate=100_000, per_request=100) == 5000  # never more than the cap


def test_parked_messages_are_due_back_in_turn_and_forgotten_once_due():
    b = BacklogShare()
    dues = [b.due_in("slow", queued=25, rate=5, now=0.0) for _ in range(3)]
    assert dues == [26 / 5, 27 / 5, 28 / 5]            # one after another, behind the queue
    assert b.due_in("other", queued=0, rate=5, now=0.0) == 1 / 5  # tenants do not share a turn
    assert b.due_in("slow", queued=0, rate=5, now=100.0) == 1 / 5  # the earlier ones came due
