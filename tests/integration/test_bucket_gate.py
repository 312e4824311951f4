"""The Lua gate on a real Redis: both buckets, no debit on denial, no over-debit under contention."""

import threading
import time

import pytest
import redis

from streams.errors import BucketUnreadable, ConfigError, CostExceedsBurst, GateUnavailable
from streams.gate.gate import RedisGate, Unused
from streams.names import RedisKeys as Keys


@pytest.fixture
def gate(redis_client, namespace, limits):
    limits.set_provider("resend", 10, 10, reserve=3)
    limits.set_tenant("resend", "*", 1000, 100)
    limits.set_tenant("resend", "small", 2, 2)
    return RedisGate(redis_client, namespace)


def _snapshot(client, keys):
    return {k: client.hgetall(k) for k in keys}


def test_denial_writes_nothing(gate, redis_client, namespace):
    """Given tenant "small" (burst of 2) that has just been admitted for 2 messages,
    When it asks the gate for 2 more,
    Then it is denied, told its tenant bucket is short and to wait at most 1 s, and neither the global nor the tenant
    bucket in Redis has changed, nor their expiry (set long enough at the admission, at an unchanged rate)."""
    k = Keys(namespace)
    watched = [k.global_bucket("resend"), k.tenant_bucket("resend", "small")]
    assert gate.acquire("resend", "small", 2).allowed
    before = _snapshot(redis_client, watched)
    expiries = [redis_client.pttl(key) for key in watched]

    denied = gate.acquire("resend", "small", 2)

    assert not denied.allowed and denied.short == "tenant" and 0 < denied.wait_s <= 1.0
    assert _snapshot(redis_client, watched) == before
    assert all(0 < redis_client.pttl(key) <= was for key, was in zip(watched, expiries, strict=True))


def test_empty_tenant_bucket_does_not_consume_another_tenants_quota(gate, limits):
    """Given a global limit of 1 request a second with a burst of 10, and tenant "small" that spends its whole burst on
    one request and is then denied 5 times,
    When tenant "big" asks for 12 requests of 10 messages each,
    Then exactly 9 are admitted: the denied requests of "small" took nothing from the global bucket."""
    limits.set_provider("resend", 1, 10)  # refills one token a second: the count below is exact
    assert gate.acquire("resend", "small", 2).allowed
    for _ in range(5):
        assert not gate.acquire("resend", "small", 1).allowed
    # the denials debited nothing: of the global burst of 10, exactly 9 requests remain for "big"
    admitted = sum(gate.acquire("resend", "big", 10).allowed for _ in range(12))
    assert admitted == 9


def test_a_request_sent_with_fewer_messages_gives_back_only_their_tenant_tokens(gate, limits):
    """Given tenant "small" (burst of 2) admitted for 2 messages, and a global burst of 10 requests refilling one
    a second, of which that admission took one and 8 more requests take 8,
    When the caller sent 1 message of the 2 in its request (`Unused(requests=0)`), and gives the other back,
    Then the tenant may send exactly one message more at once, and the global bucket still holds one request:
    the request that went out stays paid for."""
    limits.set_provider("resend", 1, 10)
    assert gate.acquire("resend", "small", 2).allowed
    assert all(gate.acquire("resend", "big", 1).allowed for _ in range(8))

    gate.refund_many([Unused("resend", "small", 1, requests=0)])

    assert not gate.acquire("resend", "small", 2).allowed
    assert gate.acquire("resend", "small", 1).allowed  # the global bucket's last request
    assert not gate.acquire("resend", "big", 1).allowed


def test_marketing_cannot_take_the_transactional_reserve(gate, limits):
    """Given a provider burst of 10 requests of which 3 are reserved for transactional traffic (refilling one in
    100 s: none comes back during the test, however slow the machine),
    When marketing requests (which must respect the reserve) take 7 and ask for an eighth,
    Then the eighth is held back on the global bucket, while a transactional request from another tenant still
    passes."""
    limits.set_provider("resend", 0.01, 10, reserve=3)
    for _ in range(7):
        assert gate.acquire("resend", "big", 1, reserve=True).allowed
    held = gate.acquire("resend", "big", 1, reserve=True)
    assert not held.allowed and held.short == "global"
    assert gate.acquire("resend", "otp-tenant", 1, reserve=False).allowed  # transactional still passes


def test_contended_gate_never_admits_more_than_the_provider_limit(gate):
    """Given a provider limit of 10 requests a second with a burst of 10,
    When 8 threads hammer the gate for 2 seconds,
    Then at most 31 requests are admitted in total (20 by rate, 10 of burst, one refill tick of slack) and at least 20,
    so the limit is used rather than starved."""
    admitted = []
    stop = time.monotonic() + 2.0

    def hammer():
        n = 0
        while time.monotonic() < stop:
            n += gate.acquire("resend", "big", 1).allowed
        admitted.append(n)

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # 10 req/s for 2 s plus a burst of 10 (plus one refill tick of slack at the edges)
    assert sum(admitted) <= 10 * 2 + 10 + 1
    assert sum(admitted) >= 10 * 2  # and the limit is used, not starved


def test_cooldown_is_shared_by_every_gate(gate, redis_client, namespace):
    """Given one worker's gate that puts the provider in a 1.5 s cool-down,
    When another worker's gate asks for a request, and the first gate then asks for a shorter 0.1 s cool-down,
    Then the other worker is held by the cool-down with a wait between 1 and 1.5 s, and the shorter cool-down does not
    cut the current one short."""
    other_worker = RedisGate(redis_client, namespace)
    gate.cool_down("resend", 1.5)
    held = other_worker.acquire("resend", "big", 1)
    assert not held.allowed and held.short == "cooldown" and 1.0 < held.wait_s <= 1.5
    gate.cool_down("resend", 0.1)  # a shorter cool-down never shortens the current one
    assert other_worker.acquire("resend", "big", 1).short == "cooldown"



def test_every_worker_exports_the_cool_down_it_is_held_by_until_the_gate_admits_again(gate, redis_client, namespace):
    """Given one worker's gate that got a quota 429 asking for an hour, and another worker's gate,
    When the other asks for a request, then an operator ends the cool-down and it asks again,
    Then both export the hour's end as `dispatch_provider_cool_down_until_timestamp_seconds` (what the
    ProviderCoolingDown alert reads) while it holds, and the other exports 0 once admitted."""
    from prometheus_client import REGISTRY

    from streams.gate.limits import LimitStore

    def exported() -> float | None:
        return REGISTRY.get_sample_value("dispatch_provider_cool_down_until_timestamp_seconds",
                                         {"provider": "resend"})

    gate.cool_down("resend", 3600)
    assert 3590 < exported() - time.time() <= 3600
    other_worker = RedisGate(redis_client, namespace)
    other_worker.acquire("resend", "big", 1)  # held by it: its own view, read from Redis
    assert 3590 < exported() - time.time() <= 3600
    LimitStore(redis_client, namespace).clear_cool_down("resend")
    assert other_worker.acquire("resend", "big", 1).allowed
    assert exported() == 0


def test_the_exported_cool_down_is_the_shared_accounts_and_follows_an_operator_without_any_request(
        gate, redis_client, namespace, limits):
    """Given a worker's gate that learned of resend's hour-long cool-down, serving also a tenant with a provider
    account of its own,
    When that tenant is admitted (its account is not cooling down), then an operator ends the cool-down while the
    worker sends nothing to resend,
    Then the exported end stays the shared account's hour through the own-account admission (before: it went to
    0, and the ProviderCoolingDown alert could never hold for a minute), and goes to 0 at the gate's next look at
    Redis, with no request (before: it stayed until the hour's end, and paged)."""
    from prometheus_client import REGISTRY

    from streams.gate import gate as gate_module
    from streams.gate.limits import LimitStore

    def exported() -> float | None:
        return REGISTRY.get_sample_value("dispatch_provider_cool_down_until_timestamp_seconds",
                                         {"provider": "resend"})

    worker = RedisGate(redis_client, namespace, own_account=lambda provider, tenant: tenant == "own")
    worker.cool_down("resend", 3600)
    assert worker.acquire("resend", "own", 1).allowed
    assert 3590 < exported() - time.time() <= 3600
    worker.refresh_cool_downs()  # asks Redis: the hour is there; the next look is COOL_DOWN_REFRESH_S away
    LimitStore(redis_client, namespace).clear_cool_down("resend")
    assert 3590 < exported() - time.time() <= 3600
    worker._next_cool_read -= gate_module.COOL_DOWN_REFRESH_S  # the refresh interval has passed
    worker.refresh_cool_downs()
    assert exported() == 0


def test_a_tenant_with_its_own_provider_account_spends_neither_the_shared_tokens_nor_its_cool_down(
        gate, redis_client, namespace):
    """Given resend's shared account with 10 tokens (burst 10) spent to the last by tenant big, and in a cool-down,
    and tenant own, whose requests go out under a Resend account of its own,
    When own asks for requests,
    Then own is admitted, though the shared bucket is empty and cooling down, while big is held by the cool-down
    (before, every tenant spent the shared account's tokens and waited on its cool-downs); and own's requests left
    the shared bucket as it was."""
    own_gate = RedisGate(redis_client, namespace, own_account=lambda provider, tenant: tenant == "own")
    for _ in range(10):
        assert own_gate.acquire("resend", "big", 1).allowed
    shared = Keys(namespace).global_bucket("resend")
    spent = redis_client.hget(shared, "mt")
    own_gate.cool_down("resend", 60)
    assert own_gate.acquire("resend", "big", 1).short == "cooldown"
    assert all(own_gate.acquire("resend", "own", 1).allowed for _ in range(5))
    assert redis_client.hget(shared, "mt") == spent

def test_a_429_of_a_tenants_own_account_holds_every_worker_off_that_account_only(gate, redis_client, namespace):
    """Given tenant own sending under a Resend account of its own, and tenant big under the shared one,
    When a worker meets a 429 of own's account asking for 60 s,
    Then any worker (here: another gate, as a worker of the other lane) is held off own's account for the minute,
    and big is not (before: only the queue of the worker that met the 429 was held, and own's other lane's worker
    kept calling the provider through its Retry-After)."""
    def owns(provider, tenant):
        return tenant == "own"

    met_it, other_lane = RedisGate(redis_client, namespace, own_account=owns), RedisGate(redis_client, namespace,
                                                                                         own_account=owns)
    met_it.cool_down("resend", 60, tenant="own")
    held = other_lane.acquire("resend", "own", 1)
    assert (held.allowed, held.short) == (False, "cooldown") and 55 < held.wait_s <= 60
    assert other_lane.acquire("resend", "big", 1).allowed
    assert not redis_client.exists(Keys(namespace).cool("resend"))


def test_misconfiguration_and_outage_fail_closed(gate, redis_client, namespace):
    """Given rate limits configured for "resend" only, and a second gate pointing at a Redis that is not reachable,
    When a tenant asks for more messages than its burst of 2, a request is made for the unconfigured provider "sms",
    and the unreachable gate is asked for a request,
    Then each is refused with an error that says why (the cost exceeds the tenant burst of 2, no rate limits are
    configured for 'sms', the gate is failing closed) instead of being let through."""
    with pytest.raises(CostExceedsBurst, match="exceeds the tenant burst of 2"):
        gate.acquire("resend", "small", 3)
    with pytest.raises(ConfigError, match="no rate limits configured for provider 'sms'"):
        gate.acquire("sms", "big", 1)
    down = RedisGate(redis.Redis(port=1, socket_connect_timeout=0.2), namespace)
    with pytest.raises(GateUnavailable, match="failing closed"):
        down.acquire("resend", "big", 1)


def test_a_bucket_redis_holds_in_a_broken_shape_fails_only_its_own_request(gate, redis_client, namespace):
    """Given tenant "broken" whose bucket key Redis holds as something else than a bucket (written by hand, by
    another program or another version), in a round with two other tenants' requests,
    When the round asks the gate,
    Then "broken" alone gets an error naming it, and the others are admitted; before, the round failed as a
    whole (every tenant of the worker held as for a Redis outage, round after round, while the requests decided
    before the error kept their tokens)."""
    redis_client.set(Keys(namespace).tenant_bucket("resend", "broken"), "5")
    answers = gate.acquire_many([("resend", "a", 1, False), ("resend", "broken", 1, False), ("resend", "b", 1, False)])
    assert answers[0].allowed and answers[2].allowed
    assert isinstance(answers[1], BucketUnreadable) and "'broken'" in str(answers[1])
    with pytest.raises(BucketUnreadable):  # asked alone (a request re-sent after an unknown outcome), the same
        gate.acquire("resend", "broken", 1)


def test_an_ended_cool_down_is_told_by_redis_clock_not_by_the_hosts(redis_client, namespace):
    """Given resend's cool-down with 3 s left by Redis's clock, its moment written when Redis's clock was 5 s behind
    this host's,
    When an operator ends it,
    Then it was ended with about 3 s left, as `cool_down_left` read it just before (before: the moment was compared
    with the host's clock: "no cool-down", 0 s left, and the ending was on no audit record)."""
    from streams.gate.limits import LimitStore

    store = LimitStore(redis_client, namespace)
    redis_moment_ms = int(time.time() * 1000) - 5000 + 3000
    redis_client.set(Keys(namespace).cool("resend"), redis_moment_ms, px=3000 + 1000)  # as cooldown.lua sets it
    assert 2.5 < store.cool_down_left("resend") <= 3
    assert 2.5 < store.clear_cool_down("resend") <= 3
    assert store.cool_down_left("resend") == 0 and store.clear_cool_down("resend") == 0
