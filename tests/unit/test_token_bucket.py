"""The token-bucket reference: admits within limits, denies without debiting, waits exactly."""

import pytest

from streams.gate.token_bucket import Bucket, Limit, decide, refill

G, T = Limit(rate=10, burst=10), Limit(rate=100, burst=100)


def test_fresh_buckets_admit_and_debit_both():
    d = decide(None, G, None, T, request_cost=1, message_cost=100, now_ms=0)
    assert d.allowed and d.global_after.millitokens == 9000 and d.tenant_after.millitokens == 0


def test_short_tenant_waits_exactly_and_nothing_is_debited():
    g, t = Bucket(10_000, 0), Bucket(0, 0)
    d = decide(g, G, t, T, 1, 50, now_ms=0)
    assert not d.allowed and d.short == "tenant" and d.wait_ms == 500
    assert (d.global_after, d.tenant_after) == (g, t)
    assert decide(g, G, t, T, 1, 50, now_ms=500).allowed


def test_global_shortage_reports_global_and_the_longer_wait():
    d = decide(Bucket(0, 0), G, Bucket(0, 0), T, 1, 1, now_ms=0)
    assert (d.allowed, d.short, d.wait_ms) == (False, "global", 100)


def test_reserve_keeps_the_last_tokens_for_callers_without_it():
    g = Bucket(2_000, 0)
    assert not decide(g, G, None, T, 1, 1, 0, reserve_tokens=2).allowed
    assert decide(g, G, None, T, 1, 1, 0, reserve_tokens=0).allowed


def test_cooldown_denies_until_it_ends():
    d = decide(None, G, None, T, 1, 1, now_ms=1000, cool_until_ms=4000)
    assert (d.allowed, d.short, d.wait_ms) == (False, "cooldown", 3000)


def test_cost_above_burst_is_an_error_not_an_endless_wait():
    with pytest.raises(ValueError, match="exceeds the tenant burst 100"):
        decide(None, G, None, T, 1, 101, 0)


def test_refill_caps_at_burst_and_ignores_clock_going_back():
    assert refill(Bucket(0, 0), G, 10_000).millitokens == 10_000
    assert refill(Bucket(5, 100), G, 50).millitokens == 5


def test_admissions_over_a_window_never_exceed_rate_times_window_plus_burst():
    g, t, admitted = None, None, 0
    for now in range(0, 10_000, 7):  # 10 s, a request attempt every 7 ms
        d = decide(g, G, t, T, 1, 1, now)
        g, t = d.global_after, d.tenant_after
        admitted += d.allowed
    assert admitted <= 10 * 10 + 10
    assert admitted >= 10 * 10  # and the limit is actually used
