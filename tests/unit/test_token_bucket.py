"""The token-bucket reference: admits within limits, denies without debiting, waits exactly."""

import pytest
import redis

from streams.gate.gate import _unreadable
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


def test_a_rate_below_one_a_second_refills_a_fraction_and_waits_for_the_rest():
    """A tenant limited to 30 a minute (0.5 a second) with a burst of 1: its bucket refills half a token in a
    second, and the next token is due a second later; over a minute it is admitted 30 times and the burst at most."""
    slow = Limit(rate=0.5, burst=1)
    assert refill(Bucket(0, 0), slow, 1000).millitokens == 500
    d = decide(None, G, Bucket(0, 0), slow, 1, 1, now_ms=1000)
    assert (d.allowed, d.short, d.wait_ms) == (False, "tenant", 1000)
    assert decide(None, G, Bucket(0, 0), slow, 1, 1, now_ms=2000).allowed
    third = Limit(rate=1 / 3, burst=1)  # not exact in binary: the wait may round up one ms, never down
    d = decide(None, G, Bucket(0, 0), third, 1, 1, now_ms=1000)
    assert not d.allowed and d.wait_ms in (2000, 2001)
    assert decide(None, G, Bucket(0, 0), third, 1, 1, now_ms=1000 + d.wait_ms).allowed
    g, t, admitted = None, None, 0
    for now in range(0, 60_000, 7):
        d = decide(g, G, t, slow, 1, 1, now)
        g, t = d.global_after, d.tenant_after
        admitted += d.allowed
    assert 30 <= admitted <= 30 + 1  # 30 a minute and the burst, at most; a poll every 7 ms loses a few ms a turn


def test_admissions_over_a_window_never_exceed_rate_times_window_plus_burst():
    g, t, admitted = None, None, 0
    for now in range(0, 10_000, 7):  # 10 s, a request attempt every 7 ms
        d = decide(g, G, t, T, 1, 1, now)
        g, t = d.global_after, d.tenant_after
        admitted += d.allowed
    assert admitted <= 10 * 10 + 10
    assert admitted >= 10 * 10  # and the limit is actually used


@pytest.mark.parametrize("error, unreadable", [
    (redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value script: 37, on "
                         "@user_script:1."), True),
    (redis.ResponseError("user_script:1: attempt to perform arithmetic on field '?' (a boolean value) script: 32, "
                         "on @user_script:1."), True),
    (redis.ResponseError("MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist "
                         "to disk. script: 37, on @user_script:51."), False),
    (redis.ResponseError("NOREPLICAS Not enough good replicas to write."), False),
    (redis.exceptions.ReadOnlyError("You can't write against a read only replica."), False),
    (redis.exceptions.MovedError("3999 127.0.0.1:6381"), False),
    (redis.ConnectionError("Connection refused"), False),
])
def test_only_a_scripts_error_about_its_own_keys_fails_one_request_of_a_round(error, unreadable):
    """A key of another type, or the script failing on a field missing, is that request's (held alone); Redis
    refusing writes, a replica, a cluster moving or a lost connection is an outage of the gate (every request held,
    the outage back-off, DispatchHoldingForDependency). Redis 7 names the script in every error its calls met."""
    assert _unreadable(error) is unreadable


def test_a_bucket_stamped_after_the_clock_refills_from_now_once_denied():
    """Given an empty global bucket stamped a minute after now (the clock stepped back since its last admission),
    When a request is denied,
    Then the bucket keeps its tokens and is stamped now, so a tenth of a second later (one token at 10 a second) the
    next request is admitted (before: nothing refilled for that minute, every request of the provider denied)."""
    d = decide(Bucket(0, 60_000), G, None, T, 1, 1, now_ms=0)
    assert (d.allowed, d.short, d.wait_ms) == (False, "global", 100)
    assert d.global_after == Bucket(0, 0)
    assert decide(d.global_after, G, None, T, 1, 1, now_ms=100).allowed
