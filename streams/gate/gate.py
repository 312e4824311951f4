"""The bucket gate (Redis adapter): a global bucket per provider and one per tenant, both consulted
before every provider call, in one Lua round trip on Redis server time. No bypass exists.

The script (`gate.lua`) mirrors the pure reference in `token_bucket.py`; a test runs one table of
cases through both. Keys share the hash tag `{provider}`, so one call touches one Redis Cluster
slot. Redis unreachable means closed: no admission, no provider call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import redis

from .. import metrics
from ..errors import (
    BucketUnreadable,
    ConfigError,
    CostExceedsBurst,
    GateError,
    GateUnavailable,
    LimitOutOfRange,
    StoreUnavailable,
)
from ..names import RedisKeys
from ..redis_client import load_script
from .limits import LimitStore, Pacing
from .token_bucket import Limit

log = logging.getLogger(__name__)
COOL_DOWN_REFRESH_S = 10.0


@dataclass(frozen=True)
class Admission:
    allowed: bool
    wait_s: float = 0.0
    short: str = ""  # "" | "global" | "tenant" | "cooldown"


class Unused(NamedTuple):
    """Tokens an admission took for what its caller did not send: `messages` from the tenant's bucket, and
    `requests` (the admission's one, or 0 when the request went out with fewer messages) from the global one."""

    provider: str
    tenant: str
    messages: int
    requests: int = 1


class Gate(Protocol):
    def acquire(self, provider: str, tenant: str, messages: int, reserve: bool) -> Admission: ...
    def acquire_many(self, requests: list[tuple[str, str, int, bool]]) -> list[Admission | GateError | ConfigError]: ...
    def cool_down(self, provider: str, seconds: float, tenant: str | None = None) -> None: ...
    def refund_many(self, admitted: Iterable[tuple[str, str, int] | Unused]) -> None: ...
    def tenant_limit(self, provider: str, tenant: str) -> Limit: ...
    def pacing(self, provider: str) -> Pacing: ...
    def refresh_cool_downs(self) -> None: ...


def give_back(gate: Gate, unused: list[Unused]) -> None:
    """Give back what callers did not use, best effort: Redis failing here leaves those tokens spent (they refill
    with time), never fails or repeats what the caller was doing."""
    if not unused:
        return
    try:
        gate.refund_many(unused)
    except GateError as exc:
        log.warning("could not give back the gate's tokens of %d admission(s): %s", len(unused), exc)


class RedisGate:
    """`acquire` admits one provider request (cost 1) carrying `messages` messages (tenant cost)."""

    def __init__(self, client: redis.Redis, namespace: str = "",
                 own_account: Callable[[str, str], bool] | None = None):
        self.client = client
        self.namespace = namespace
        # (provider, tenant) -> the tenant's requests go out under an account of its own at the provider
        self.own_account = own_account
        self.keys = RedisKeys(namespace)
        self._acquire = client.register_script(load_script(__package__, "gate.lua"))
        self._cool = client.register_script(load_script(__package__, "cooldown.lua"))
        self._refund = client.register_script(load_script(__package__, "refund.lua"))
        # provider -> when its cool-down ends, as this process last learned it (exported for the alert)
        self._cooling: dict[str, float] = {}
        self._next_cool_read = 0.0

    def acquire(self, provider: str, tenant: str, messages: int, reserve: bool = False) -> Admission:
        try:
            reply = self._acquire(keys=self._keys(provider, tenant),
                                  args=[tenant, 1, messages, "1" if reserve else "0"])
        except redis.RedisError as exc:
            raise _failure(provider, tenant, exc) from None
        return self._admission(reply, provider, tenant, messages)

    def acquire_many(self, requests: list[tuple[str, str, int, bool]]) -> list[Admission | GateError | ConfigError]:
        """Several admissions (provider, tenant, messages, reserve) in one round trip; each is decided
        on its own, atomically, exactly as `acquire` would; a cost that can never pass comes back as
        its error instead of an admission."""
        pipe = self.client.pipeline(transaction=False)
        for provider, tenant, messages, reserve in requests:
            self._acquire(keys=self._keys(provider, tenant), args=[tenant, 1, messages, "1" if reserve else "0"],
                          client=pipe)
        try:
            replies = pipe.execute(raise_on_error=False)
        except redis.RedisError as exc:
            raise GateUnavailable(f"bucket gate unavailable ({exc}); failing closed") from None
        out: list[Admission | GateError | ConfigError] = []
        unavailable: GateError | None = None
        for (provider, tenant, messages, _), reply in zip(requests, replies, strict=True):
            if isinstance(reply, Exception):
                failure = _failure(provider, tenant, reply)
                if not isinstance(failure, BucketUnreadable):
                    unavailable = unavailable or failure
                out.append(failure)  # its error alone, not the round's
                continue
            try:
                out.append(self._admission(reply, provider, tenant, messages))
            except (GateError, ConfigError) as exc:
                out.append(exc)
        if unavailable is not None:
            # The round fails (a Redis Cluster master down for some buckets): what the other masters admitted in it
            # is given back, or those tokens would be spent on requests that are never sent.
            give_back(self, [Unused(p, t, m) for (p, t, m, _), a in zip(requests, out, strict=True)
                             if isinstance(a, Admission) and a.allowed])
            raise unavailable
        return out

    def refund_many(self, admitted: Iterable[tuple[str, str, int] | Unused]) -> None:
        """Give back admissions whose callers did not use them, in one round trip: a (provider, tenant, messages)
        is a whole admission, an `Unused` may be part of one."""
        unused = [Unused(*a) for a in admitted]
        if not unused:
            return
        pipe = self.client.pipeline(transaction=False)
        for provider, tenant, messages, requests in unused:
            self._refund(keys=self._keys(provider, tenant)[:3], args=[tenant, requests, messages], client=pipe)
        try:
            # Errors come back per refund: one raised out of a cluster pipeline would have it send every refund
            # again, those that landed included (tokens given back twice).
            replies = pipe.execute(raise_on_error=False)
        except redis.RedisError as exc:
            raise GateUnavailable(f"bucket gate unavailable ({exc}); nothing given back") from None
        failed = [reply for reply in replies if isinstance(reply, Exception)]
        if failed:
            raise GateUnavailable(f"bucket gate unavailable ({failed[0]}); {len(failed)} of {len(unused)} "
                                  "admissions not given back")

    def _own(self, provider: str, tenant: str) -> bool:
        return self.own_account is not None and self.own_account(provider, tenant)

    def _keys(self, provider: str, tenant: str) -> list[str]:
        k = self.keys
        if self._own(provider, tenant):
            # Its own account at the provider: neither the shared account's tokens nor its cool-down are its.
            return [k.limits(provider), k.own_account_global(provider, tenant), k.tenant_bucket(provider, tenant),
                    k.own_account_cool(provider, tenant)]
        return [k.limits(provider), k.global_bucket(provider), k.tenant_bucket(provider, tenant), k.cool(provider)]

    def _admission(self, reply: list, provider: str, tenant: str, messages: int) -> Admission:
        status, value, short = reply
        short = short.decode() if isinstance(short, bytes) else short
        shared = not self._own(provider, tenant)  # it read the shared cool-down
        if status == 1:
            if provider in self._cooling and shared:  # the cool-down is over (or an operator ended it)
                self._cool_down_over(provider)
            return Admission(True)
        if status == 0:
            if short == "cooldown" and shared:
                self._cooling_until(provider, time.time() + value / 1000.0, extend_only=False)
            return Admission(False, value / 1000.0, short)
        if status == -1:
            raise CostExceedsBurst(f"{provider}: a cost of {messages if short == 'tenant' else 1} exceeds "
                                   f"the {short} burst of {value} for tenant {tenant!r}")
        if status == -3:
            raise LimitOutOfRange(f"the {short} limit of provider {provider!r} (for tenant {tenant!r}) holds a rate "
                                  "not above 0 or a burst below 1 (edited by hand); an operator sets it again with "
                                  "`streams limits set`")
        raise ConfigError(f"no rate limits configured for provider {provider!r} (or tenant {tenant!r}); "
                          f"an operator sets them with `streams limits set`")

    def cool_down(self, provider: str, seconds: float, tenant: str | None = None) -> None:
        """Hold every worker off `provider` for `seconds` (extends, never shortens): off the account everyone
        shares, or, given the `tenant` whose account of its own there answered the 429, off that account (every
        worker, of both lanes, sending under it). Never the shared account's for a tenant's own."""
        key = self.keys.cool(provider) if tenant is None else self.keys.own_account_cool(provider, tenant)
        try:
            self._cool(keys=[key], args=[max(1, int(seconds * 1000))])
        except redis.RedisError as exc:
            raise GateUnavailable(f"cannot record the provider cool-down ({exc})") from None
        if tenant is None:  # the exported cool-down (and its alert) is the shared account's
            self._cooling_until(provider, time.time() + seconds, extend_only=True)

    def refresh_cool_downs(self) -> None:
        """While this process knows of a cool-down, it asks Redis again within COOL_DOWN_REFRESH_S, work or not:
        an operator may have ended it (the exported end would otherwise stay, and page, until the old end)."""
        now = time.monotonic()
        if not self._cooling or now < self._next_cool_read:
            return
        self._next_cool_read = now + COOL_DOWN_REFRESH_S
        store = LimitStore(self.client, self.namespace)
        for provider in list(self._cooling):
            try:
                left = store.cool_down_left(provider)
            except StoreUnavailable:
                return  # asked again next time; the gate's own calls meet the outage meanwhile
            if left:
                self._cooling_until(provider, time.time() + left, extend_only=False)
            else:
                self._cool_down_over(provider)

    def _cool_down_over(self, provider: str) -> None:
        del self._cooling[provider]
        metrics.COOL_DOWN_UNTIL.labels(provider).set(0)

    def _cooling_until(self, provider: str, until: float, extend_only: bool) -> None:
        """The gate's answer is Redis's word (it may be shorter: an operator ended it); a 429 only extends."""
        if extend_only:
            until = max(until, self._cooling.get(provider, 0.0))
        self._cooling[provider] = until
        metrics.COOL_DOWN_UNTIL.labels(provider).set(until)

    def tenant_limit(self, provider: str, tenant: str) -> Limit:
        return LimitStore(self.client, self.namespace).tenant(provider, tenant)

    def pacing(self, provider: str) -> Pacing:
        return LimitStore(self.client, self.namespace).pacing(provider)


def _unreadable(exc: Exception) -> bool:
    """Whether a script's error is about the keys it was given (a key of another type; its Lua failing on a
    field missing), in Redis 7's wording, rather than about Redis (MISCONF, OOM, NOREPLICAS, a cluster moving,
    a read-only replica), which is an outage of the gate. Redis 7 appends `on @user_script` to any error a
    script's own calls met, so the text's beginning decides."""
    return type(exc) is redis.ResponseError and str(exc).startswith(("WRONGTYPE", "user_script:"))


def _failure(provider: str, tenant: str, exc: Exception) -> GateUnavailable:
    """What a failed gate script means: this request's buckets unreadable, or the gate unavailable."""
    if _unreadable(exc):
        return BucketUnreadable(f"the buckets of provider {provider!r} for tenant {tenant!r} cannot be read ({exc})")
    return GateUnavailable(f"bucket gate unavailable ({exc}); failing closed")
