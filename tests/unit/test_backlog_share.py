"""A tenant's share of a worker's buffer, and when its excess comes back (pure)."""

import pytest

from streams.dispatch.backlog import BacklogShare


def test_share_is_a_few_seconds_of_the_tenants_rate_within_bounds():
    b = BacklogShare(horizon_s=10, max_share=5000)
    assert b.share(rate=5, per_request=5) == 50
    assert b.share(rate=1, per_request=100) == 100       # at least one full request
    assert b.share(rate=100_000, per_request=100) == 5000  # never more than the cap


def test_a_throttled_tenants_excess_is_parked_in_turn_and_forgotten_once_due():
    b = BacklogShare(horizon_s=10)
    assert b.park("slow", queued=49, rate=5, per_request=5, now=0.0) is None  # within its share
    dues = []
    for _ in range(3):
        dues.append(b.park("slow", queued=50, rate=5, per_request=5, now=0.0))
        b.parked("slow", dues[-1])
    assert dues == pytest.approx([51 / 5, 52 / 5, 53 / 5])   # one after another, behind the queue
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
    assert b.excess(queued=20, in_queue=20, rate=5, per_request=1, burst=10) == 5
    assert b.excess(queued=20, in_queue=20, rate=5, per_request=1) == 15



def test_a_tenant_whose_bucket_lets_nothing_go_within_the_horizon_holds_nothing():
    """Given a transactional tenant limited to 5 a minute whose bucket is dry (its next token 12 s away),
    Then while its queue is held its share is nothing, and a message of it is parked for its turn (before: one
    request's worth was always held, its message pinning the partition's committed offset 12 s: every other
    tenant's OTPs meanwhile counted as lag, and marketing yielded for all); while it is not held, one message, which
    asks the gate (a limit raised meanwhile applies), and only the messages behind it are parked."""
    b = BacklogShare(horizon_s=1)
    assert b.share(rate=5 / 60, per_request=1, held=True) == 0 and b.share(rate=5 / 60, per_request=1, burst=5) == 5
    assert b.park("slow", queued=0, rate=5 / 60, per_request=1, now=0.0, held=True) == pytest.approx(12)
    assert b.excess(queued=1, in_queue=1, rate=5 / 60, per_request=1, held=True) == 1
    assert b.share(rate=5 / 60, per_request=1) == 1
    assert b.park("slow", queued=0, rate=5 / 60, per_request=1, now=0.0) is None
    assert b.excess(queued=3, in_queue=3, rate=5 / 60, per_request=1) == 2


def test_a_queue_not_held_keeps_its_head_whatever_its_tenants_other_queues_hold():
    """Given a tenant whose share is measured over three queues (a webhook tenant's endpoints) holding 30, one of
    them holding 2,
    Then what that queue may give up is at most one (its head asks the gate), or both while it is held."""
    b = BacklogShare(horizon_s=1)
    assert b.excess(queued=30, in_queue=2, rate=5 / 60, per_request=1) == 1
    assert b.excess(queued=30, in_queue=2, rate=5 / 60, per_request=1, held=True) == 2


def test_what_a_blast_parked_is_one_due_time_and_one_parked_past_its_max_age_holds_no_turn():
    """Given a tenant at 5 a second that parked a million messages, the last due about 2.3 days ahead, but each
    parked until its max age at most (2 days),
    When a message over its share comes an hour after the last of them came back (past their max age),
    Then it is parked for its own turn (seconds), and the backlog keeps one due time for the tenant (before: one a
    message, a million kept, and the new one parked behind turns that were never taken: 6.6 hours)."""
    b = BacklogShare(horizon_s=10)
    two_days = 2 * 24 * 3600.0
    for _ in range(1_000_000):
        b.parked("blast", min(b.park("blast", queued=50, rate=5, per_request=1, now=0.0), two_days))
    assert len(b._last_due) == 1
    assert b.park("blast", queued=50, rate=5, per_request=1, now=two_days + 3600) == pytest.approx(51 / 5)
