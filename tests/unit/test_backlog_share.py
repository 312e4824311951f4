"""A tenant's share of a worker's buffer, and when its excess comes back (pure)."""

from streams.dispatch.backlog import BacklogShare


def test_share_is_a_few_seconds_of_the_tenants_rate_within_bounds():
    b = BacklogShare(horizon_s=10, max_share=5000)
    assert b.share(rate=5, per_request=5) == 50
    assert b.share(rate=1, per_request=100) == 100       # at least one full request
    assert b.share(rate=100_000, per_request=100) == 5000  # never more than the cap


def test_a_throttled_tenants_excess_is_parked_in_turn_and_forgotten_once_due():
    b = BacklogShare(horizon_s=10)
    assert b.park("slow", queued=49, rate=5, per_request=5, now=0.0) is None  # within its share
    dues = [b.park("slow", queued=50, rate=5, per_request=5, now=0.0) for _ in range(3)]
    assert dues == [51 / 5, 52 / 5, 53 / 5]                  # one after another, behind the queue
    assert b.park("other", queued=50, rate=5, per_request=5, now=0.0) == 51 / 5  # tenants do not share a turn
    assert b.park("slow", queued=50, rate=5, per_request=5, now=100.0) == 51 / 5  # the earlier ones came due


def test_a_fast_tenant_whose_turn_is_near_is_never_parked():
    b = BacklogShare(horizon_s=10, max_share=5000)
    assert b.park("fast", queued=5000, rate=100_000, per_request=100, now=0.0) is None
