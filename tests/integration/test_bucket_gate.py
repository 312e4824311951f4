"""The Lua gate on a real Redis: both buckets, no debit on denial, no over-debit under contention."""

import threading
import time

import pytest
import redis

from streams.errors import ConfigError, CostExceedsBurst, GateUnavailable
from streams.gate import Keys, RedisGate


@pytest.fixture
def gate(redis_client, namespace, limits):
    limits.set_provider("resend", 10, 10, reserve=3)
    limits.set_tenant("resend", "*", 1000, 100)
    limits.set_tenant("resend", "small", 2, 2)
    return RedisGate(redis_client, namespace)


def _snapshot(client, keys):
    return {k: client.hgetall(k) for k in keys}


def test_denial_writes_nothing(gate, redis_client, namespace):
    k = Keys(namespace)
    watched = [k.global_bucket("resend"), k.tenant_bucket("resend", "small")]
    assert gate.acquire("resend", "small", 2).allowed
    before = _snapshot(redis_client, watched)

    denied = gate.acquire("resend", "small", 2)

    assert not denied.allowed and denied.short == "tenant" and 0 < denied.wait_s <= 1.0
    assert _snapshot(redis_client, watched) == before


def test_empty_tenant_bucket_does_not_consume_another_tenants_quota(gate, limits):
    limits.set_provider("resend", 1, 10)  # refills one token a second: the count below is exact
    assert gate.acquire("resend", "small", 2).allowed
    for _ in range(5):
        assert not gate.acquire("resend", "small", 1).allowed
    # the denials debited nothing: of the global burst of 10, exactly 9 requests remain for "big"
    admitted = sum(gate.acquire("resend", "big", 10).allowed for _ in range(12))
    assert admitted == 9


def test_marketing_cannot_take_the_transactional_reserve(gate):
    for _ in range(7):
        assert gate.acquire("resend", "big", 1, reserve=True).allowed
    held = gate.acquire("resend", "big", 1, reserve=True)
    assert not held.allowed and held.short == "global"
    assert gate.acquire("resend", "otp-tenant", 1, reserve=False).allowed  # transactional still passes


def test_contended_gate_never_admits_more_than_the_provider_limit(gate):
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
    other_worker = RedisGate(redis_client, namespace)
    gate.cool_down("resend", 1.5)
    held = other_worker.acquire("resend", "big", 1)
    assert not held.allowed and held.short == "cooldown" and 1.0 < held.wait_s <= 1.5
    gate.cool_down("resend", 0.1)  # a shorter cool-down never shortens the current one
    assert other_worker.acquire("resend", "big", 1).short == "cooldown"


def test_misconfiguration_and_outage_fail_closed(gate, redis_client, namespace):
    with pytest.raises(CostExceedsBurst, match="exceeds the tenant burst of 2"):
        gate.acquire("resend", "small", 3)
    with pytest.raises(ConfigError, match="no rate limits configured for provider 'sms'"):
        gate.acquire("sms", "big", 1)
    down = RedisGate(redis.Redis(port=1, socket_connect_timeout=0.2), namespace)
    with pytest.raises(GateUnavailable, match="failing closed"):
        down.acquire("resend", "big", 1)
