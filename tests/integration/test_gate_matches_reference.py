"""The Lua gate (gate.lua, run by Redis) and its pure Python reference (token_bucket.py) agree.

Given one table of cases (limits, bucket contents, costs, reserve, cool-down), when each case runs
through the real Redis script and through the reference, then both admit or deny alike, name the
same short bucket, ask for the same wait, and leave the same bucket contents. Buckets are stamped
in the future so neither side refills while the case runs: the comparison is exact.
"""

from dataclasses import dataclass

import pytest

from streams.errors import CostExceedsBurst
from streams.gate.gate import RedisGate
from streams.gate.token_bucket import Bucket, Limit, decide
from streams.names import RedisKeys

FUTURE_MS = 60_000


@dataclass(frozen=True)
class Case:
    name: str
    global_limit: Limit
    tenant_limit: Limit
    global_mt: float | None    # millitokens in the global bucket (None: never used, starts full)
    tenant_mt: float | None
    messages: int = 1
    reserve: int = 0
    marketing: bool = False
    cool_for_ms: int = 0
    tenant_specific: bool = True  # the tenant's own limit, else the '*' default


CASES = [
    Case("both full", Limit(10, 10), Limit(100, 100), None, None),
    Case("exactly enough", Limit(10, 10), Limit(5, 5), 1000, 5000, messages=5),
    Case("tenant short", Limit(10, 10), Limit(2, 4), 10_000, 1500, messages=2),
    Case("global short", Limit(4, 10), Limit(100, 100), 300, None),
    Case("both short, global longer", Limit(1, 10), Limit(100, 100), 0, 99_000, messages=2),
    Case("both short, tenant longer", Limit(50, 10), Limit(1, 100), 500, 0, messages=3),
    Case("reserve holds marketing", Limit(10, 10), Limit(100, 100), 3000, None, reserve=3, marketing=True),
    Case("reserve does not hold transactional", Limit(10, 10), Limit(100, 100), 3000, None, reserve=3),
    Case("reserve capped at burst minus cost", Limit(10, 5), Limit(100, 100), 5000, None, reserve=9,
         marketing=True),
    Case("default tenant limit", Limit(10, 10), Limit(3, 3), None, 2000, messages=3, tenant_specific=False),
    Case("cool-down", Limit(10, 10), Limit(100, 100), None, None, cool_for_ms=FUTURE_MS),
    Case("cost above the tenant burst", Limit(10, 10), Limit(5, 5), None, None, messages=6),
    Case("tenant short at half a token a second", Limit(10, 10), Limit(0.5, 1), 10_000, 200),
    Case("global short at a quarter of a request a second", Limit(0.25, 2), Limit(100, 100), 900, None),
    Case("a fraction of a millitoken left after the debit", Limit(10, 10), Limit(1 / 3, 2), None,
         1333.3333333333333),
    Case("short by a fraction of a millitoken", Limit(10, 10), Limit(1 / 3, 2), None, 999.9999999999999),
    # 1000 / (1/3) rounds to 3000.0 in doubles, as Lua divides; the exact quotient's ceiling would be 3001.
    Case("empty at a third of a token a second", Limit(10, 10), Limit(1 / 3, 1), None, 0),
]


def _seed(client, keys: RedisKeys, case: Case, now_ms: int) -> None:
    tenant_field = "acme" if case.tenant_specific else "*"
    client.hset(keys.limits("p"), mapping={
        "global_rate": case.global_limit.rate, "global_burst": case.global_limit.burst, "reserve": case.reserve,
        f"tenant_rate:{tenant_field}": case.tenant_limit.rate,
        f"tenant_burst:{tenant_field}": case.tenant_limit.burst})
    for key, mt in ((keys.global_bucket("p"), case.global_mt), (keys.tenant_bucket("p", "acme"), case.tenant_mt)):
        if mt is not None:
            client.hset(key, mapping={"mt": mt, "ts": now_ms + FUTURE_MS})
    if case.cool_for_ms:
        client.set(keys.cool("p"), now_ms + case.cool_for_ms)


def _bucket(client, key: str) -> float | None:
    raw = client.hget(key, "mt")
    return None if raw is None else float(raw)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_lua_gate_and_reference_agree(case, redis_client, namespace):
    """Given one case of the table (limits, bucket contents stamped in the future, cost, reserve, cool-down) seeded in
    Redis,
    When the same request runs through the Lua gate on Redis and through the pure Python reference,
    Then both admit or deny alike, name the same short bucket, ask for the same wait (within 50 ms for a cool-down) and
    leave the same bucket contents, untouched on a denial; a cost above the tenant burst is refused by both."""
    keys = RedisKeys(namespace)
    seconds, micros = redis_client.time()
    now_ms = seconds * 1000 + micros // 1000
    _seed(redis_client, keys, case, now_ms)
    stamp = now_ms + FUTURE_MS
    reserve = case.reserve if case.marketing else 0

    try:
        expected = decide(None if case.global_mt is None else Bucket(case.global_mt, stamp), case.global_limit,
                          None if case.tenant_mt is None else Bucket(case.tenant_mt, stamp), case.tenant_limit,
                          1, case.messages, now_ms, reserve_tokens=reserve,
                          cool_until_ms=now_ms + case.cool_for_ms if case.cool_for_ms else 0)
    except ValueError:
        with pytest.raises(CostExceedsBurst):
            RedisGate(redis_client, namespace).acquire("p", "acme", case.messages, reserve=case.marketing)
        return

    got = RedisGate(redis_client, namespace).acquire("p", "acme", case.messages, reserve=case.marketing)

    assert got.allowed == expected.allowed
    assert got.short == expected.short
    if expected.short == "cooldown":  # measured from each side's own clock reading
        assert abs(got.wait_s * 1000 - expected.wait_ms) <= 50
    else:
        assert round(got.wait_s * 1000) == expected.wait_ms
    global_after = _bucket(redis_client, keys.global_bucket("p"))
    tenant_after = _bucket(redis_client, keys.tenant_bucket("p", "acme"))
    if expected.allowed:
        assert (global_after, tenant_after) == (expected.global_after.millitokens, expected.tenant_after.millitokens)
    else:  # a denial writes nothing
        assert (global_after, tenant_after) == (case.global_mt, case.tenant_mt)
