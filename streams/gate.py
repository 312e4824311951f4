"""The bucket gate (Redis adapter): a global bucket per provider and one per tenant, both consulted
before every provider call, in one Lua round trip on Redis server time. No bypass exists.

Keys share the hash tag `{provider}` so one call touches one Redis Cluster slot. Limits live in
Redis (`{ns}dr:{provider}:limits`) and are written only by operators (`streams limits set`).
Redis unreachable means closed: no admission, no provider call.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from typing import Protocol

import redis

from .errors import ConfigError, CostExceedsBurst, GateUnavailable
from .token_bucket import Limit


@dataclass(frozen=True)
class Admission:
    allowed: bool
    wait_s: float = 0.0
    short: str = ""  # "" | "global" | "tenant" | "cooldown"


class Gate(Protocol):
    def acquire(self, provider: str, tenant: str, messages: int, reserve: bool) -> Admission: ...
    def cool_down(self, provider: str, seconds: float) -> None: ...
    def tenant_burst(self, provider: str, tenant: str) -> int: ...


def _script(name: str) -> str:
    return resources.files("streams").joinpath(name).read_text()


class Keys:
    def __init__(self, namespace: str = ""):
        self.ns = namespace

    def limits(self, provider: str) -> str:
        return f"{self.ns}dr:{{{provider}}}:limits"

    def global_bucket(self, provider: str) -> str:
        return f"{self.ns}dr:{{{provider}}}:global"

    def tenant_bucket(self, provider: str, tenant: str) -> str:
        return f"{self.ns}dr:{{{provider}}}:tenant:{tenant}"

    def cool(self, provider: str) -> str:
        return f"{self.ns}dr:{{{provider}}}:cool"


class RedisGate:
    """`acquire` admits one provider request (cost 1) carrying `messages` messages (tenant cost)."""

    def __init__(self, client: redis.Redis, namespace: str = ""):
        self.client = client
        self.keys = Keys(namespace)
        self._acquire = client.register_script(_script("gate.lua"))
        self._cool = client.register_script(_script("cooldown.lua"))

    def acquire(self, provider: str, tenant: str, messages: int, reserve: bool = False) -> Admission:
        k = self.keys
        try:
            status, value, short = self._acquire(
                keys=[k.limits(provider), k.global_bucket(provider), k.tenant_bucket(provider, tenant),
                      k.cool(provider)],
                args=[tenant, 1, messages, "1" if reserve else "0"])
        except redis.RedisError as exc:
            raise GateUnavailable(f"bucket gate unavailable ({exc}); failing closed") from None
        short = short.decode() if isinstance(short, bytes) else short
        if status == 1:
            return Admission(True)
        if status == 0:
            return Admission(False, value / 1000.0, short)
        if status == -1:
            raise CostExceedsBurst(f"{provider}: a cost of {messages if short == 'tenant' else 1} exceeds "
                                   f"the {short} burst of {value} for tenant {tenant!r}")
        raise ConfigError(f"no rate limits configured for provider {provider!r} (or tenant {tenant!r}); "
                          f"an operator sets them with `streams limits set`")

    def cool_down(self, provider: str, seconds: float) -> None:
        """Hold every worker off `provider` for `seconds` (extends, never shortens)."""
        try:
            self._cool(keys=[self.keys.cool(provider)], args=[max(1, int(seconds * 1000))])
        except redis.RedisError as exc:
            raise GateUnavailable(f"cannot record the provider cool-down ({exc})") from None

    def tenant_burst(self, provider: str, tenant: str) -> int:
        return LimitStore(self.client, self.keys.ns).tenant(provider, tenant).burst


class LimitStore:
    """Operator-only access to the limits. Tenant credentials never reach this (see api.py)."""

    def __init__(self, client: redis.Redis, namespace: str = ""):
        self.client = client
        self.keys = Keys(namespace)

    def set_provider(self, provider: str, rate: int, burst: int, reserve: int = 0) -> None:
        _check(rate, burst, reserve)
        self.client.hset(self.keys.limits(provider), mapping={
            "global_rate": rate, "global_burst": burst, "reserve": reserve})

    def set_tenant(self, provider: str, tenant: str, rate: int, burst: int) -> None:
        """`tenant='*'` sets the default for tenants without their own limit."""
        _check(rate, burst, 0)
        self.client.hset(self.keys.limits(provider), mapping={
            f"tenant_rate:{tenant}": rate, f"tenant_burst:{tenant}": burst})

    def show(self, provider: str) -> dict[str, int]:
        raw = self.client.hgetall(self.keys.limits(provider))
        return {k.decode(): int(v) for k, v in sorted(raw.items())}

    def tenant(self, provider: str, tenant: str) -> Limit:
        d = self.show(provider)
        rate = d.get(f"tenant_rate:{tenant}", d.get("tenant_rate:*"))
        burst = d.get(f"tenant_burst:{tenant}", d.get("tenant_burst:*"))
        if rate is None or burst is None:
            raise ConfigError(f"no limit for tenant {tenant!r} at provider {provider!r} and no default ('*')")
        return Limit(rate, burst)


def _check(rate: int, burst: int, reserve: int) -> None:
    if rate < 1 or burst < 1:
        raise ConfigError(f"rate and burst must be >= 1 (got rate={rate}, burst={burst})")
    if not 0 <= reserve < burst:
        raise ConfigError(f"reserve must be between 0 and burst-1 (got {reserve}, burst {burst})")
