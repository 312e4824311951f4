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


def test_what_the_bucket_lets_go_at_once_is_kept_and_comes_first():
    b = BacklogShare(horizon_s=1)
    assert b.share(rate=5, per_request=1, burst=10) == 15    # the burst, then a second of its rate
    assert b.share(rate=5, per_request=1) == 5               # waiting on its bucket: a second of its rate
    assert b.park("otp", queued=14, rate=5, per_request=1, now=0.0, burst=10) is None
    assert b.park("otp", queued=15, rate=5, per_request=1, now=0.0, burst=10) == (16 - 10) / 5
    assert b.excess(queued=20, rate=5, per_request=1, burst=10) == 5
    assert b.excess(queued=20, rate=5, per_request=1) == 15

