"""Two-level token-bucket maths: the reference the Redis Lua script (gate.lua) must match. Pure code.

Tokens are kept in millitokens, time in milliseconds, rates in tokens per second (so a rate of r
tokens/s refills r millitokens per ms). With whole rates every figure is an integer; a rate may also be
a fraction (0.5: one token every 2 s; 30 a minute), whose refills are fractions of a millitoken. The
arithmetic is in doubles, the same operations in the same order as the Lua script's, so both decide
alike to the bit. A decision either debits *both* buckets or debits nothing and says how long to wait;
partial debits would leak quota between tenants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Limit:
    rate: float  # tokens per second; a fraction refills one token every 1/rate seconds
    burst: int   # bucket capacity in tokens


@dataclass(frozen=True)
class Bucket:
    millitokens: float  # an integer unless a rate is a fraction
    updated_ms: int


@dataclass(frozen=True)
class Decision:
    allowed: bool
    wait_ms: int          # 0 when allowed
    short: str            # "" | "global" | "tenant" | "cooldown"
    global_after: Bucket
    tenant_after: Bucket


def refill(bucket: Bucket | None, limit: Limit, now_ms: int) -> Bucket:
    """A bucket as of now; an unseen bucket starts full."""
    full = limit.burst * 1000
    if bucket is None:
        return Bucket(full, now_ms)
    elapsed = max(0, now_ms - bucket.updated_ms)
    return Bucket(min(full, bucket.millitokens + elapsed * limit.rate), now_ms)


def _stamped_by(bucket: Bucket | None, now_ms: int) -> Bucket | None:
    return bucket if bucket is None or bucket.updated_ms <= now_ms else Bucket(bucket.millitokens, now_ms)


def _wait(have: float, need: int, rate: float) -> int:
    return 0 if have >= need else math.ceil((need - have) / rate)  # in ms, as gate.lua


def decide(
    global_bucket: Bucket | None, global_limit: Limit,
    tenant_bucket: Bucket | None, tenant_limit: Limit,
    request_cost: int, message_cost: int, now_ms: int,
    reserve_tokens: int = 0, cool_until_ms: int = 0,
) -> Decision:
    """Admit one provider request carrying `message_cost` messages, or say how long to wait.

    `reserve_tokens` is the share of the global bucket this caller may not take (marketing leaves it
    for transactional traffic). Costs larger than a burst can never be admitted: ValueError.
    """
    if request_cost > global_limit.burst:
        raise ValueError(f"request cost {request_cost} exceeds the provider burst {global_limit.burst}")
    if message_cost > tenant_limit.burst:
        raise ValueError(f"message cost {message_cost} exceeds the tenant burst {tenant_limit.burst}")
    g = refill(global_bucket, global_limit, now_ms)
    t = refill(tenant_bucket, tenant_limit, now_ms)
    if cool_until_ms > now_ms:
        return Decision(False, cool_until_ms - now_ms, "cooldown", global_bucket or g, tenant_bucket or t)
    # Denied, a bucket keeps its tokens; one stamped after `now_ms` (the clock stepped back) is stamped now, or it
    # would refill nothing until the clock is back at its stamp.
    unchanged = (_stamped_by(global_bucket, now_ms) or g, _stamped_by(tenant_bucket, now_ms) or t)
    reserve = min(reserve_tokens, global_limit.burst - request_cost)
    g_wait = _wait(g.millitokens, (request_cost + reserve) * 1000, global_limit.rate)
    t_wait = _wait(t.millitokens, message_cost * 1000, tenant_limit.rate)
    if g_wait or t_wait:
        short = "global" if g_wait >= t_wait else "tenant"
        return Decision(False, max(g_wait, t_wait), short, *unchanged)
    return Decision(True, 0, "",
                    Bucket(g.millitokens - request_cost * 1000, now_ms),
                    Bucket(t.millitokens - message_cost * 1000, now_ms))
