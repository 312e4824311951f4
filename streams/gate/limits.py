"""Rate limits, set by operators only (`streams limits set`, `PUT /v1/admin/limits/{provider}`).

Tenant credentials never reach this module. One validation serves the CLI and the API: a change
is checked against the limits it would produce, so both refuse the same things with the same words.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType
from typing import TYPE_CHECKING, NamedTuple

import orjson
import redis

from ..errors import ConfigError, SendValidationError, StoreUnavailable
from ..names import RedisKeys
from ..send import check_tenant_id
from ..state.log import write_through_log
from .token_bucket import Limit

log = logging.getLogger("streams.gate")

if TYPE_CHECKING:
    from ..state.log import OperatorLog


@dataclass(frozen=True)
class LimitChange:
    """A partial update: provider-wide fields, and/or one tenant's (or the default '*') limit."""

    global_rate: float | None = None  # tokens a second: a whole number, or a fraction (0.5, 30/min as 0.5)
    global_burst: int | None = None
    reserve: int | None = None
    tenant: str | None = None
    tenant_rate: float | None = None
    tenant_burst: int | None = None
    concurrency: int | None = None   # pacing: requests in flight per worker, at most (0: the provider's default)
    pause_ms: int | None = None      # pacing: the least pause between request waves (0: none)
    unset_tenant: str | None = None  # a tenant whose own limit is removed: held to the default ('*') again


@dataclass(frozen=True)
class Pacing:
    """Besides the buckets: how many requests a worker keeps in flight to a provider, and how long
    it waits between waves of requests. Operators change both at run time (`streams limits set
    --concurrency 5 --pause-ms 300`); workers pick them up within seconds."""

    concurrency: int | None = None   # None: the provider's own cap (providers.toml)
    pause_ms: int = 0


MIN_RATE = 1 / 86_400  # one a day
# A bucket refills from empty to full within ten years at most: the gate's figures in milliseconds (the bucket's
# expiry, a wait) then stay far below what Redis reads as an integer (a burst of 2 billion at one a day would not).
MAX_REFILL_S = 10 * 365 * 86_400
MAX_LIMIT = 2**53  # the gate's Lua works in doubles: larger rates and bursts would not be held exactly
_PER = {"s": 1, "sec": 1, "second": 1, "m": 60, "min": 60, "minute": 60, "h": 3600, "hour": 3600, "d": 86_400,
        "day": 86_400}


def parse_rate(text: str) -> float:
    """A rate as operators write it: tokens a second (`20`, `0.5`), or a count per unit (`30/min`, `100/h`,
    `500/day`). Whole rates come back as int."""
    count, _, unit = text.strip().partition("/")
    per = _PER.get(unit.strip().lower()) if "/" in text else 1
    try:
        value = float(count) / per if per else None
    except ValueError:
        value = None
    if value is None or not math.isfinite(value):
        raise ConfigError(f"{text!r} is not a rate: give tokens a second (20, 0.5) or a count per unit "
                          f"(30/min, 100/h, 500/day)")
    return normal_rate(value)


def normal_rate(value: float) -> float:
    """A whole rate as an int (what Redis then holds reads as an integer, as before fractions were allowed)."""
    return int(value) if float(value).is_integer() else float(value)


def _check_rate(what: str, rate: float, burst: int) -> None:
    if not MIN_RATE <= rate <= MAX_LIMIT:
        raise ConfigError(f"{what} rate must be at least one a day ({MIN_RATE:.7f} a second) and at most "
                          f"{MAX_LIMIT:,} a second (got {rate:g})")
    if not 1 <= burst <= MAX_LIMIT:
        raise ConfigError(f"{what} burst must be from 1 to {MAX_LIMIT:,} (got burst={burst})")
    largest = math.floor(MAX_REFILL_S * rate * (1 + 1e-12))  # a whole number of days' refill is allowed exactly
    if burst > largest:
        raise ConfigError(f"{what} burst {burst} at {rate:g} a second would take {burst / rate / 86_400:,.1f} days "
                          f"to refill, over the {MAX_REFILL_S // 86_400:,} days allowed: a burst of at most "
                          f"{largest:,} at this rate, or a higher rate")


def check_provider(rate: float, burst: int, reserve: int) -> None:
    _check_rate("global", rate, burst)
    if not 0 <= reserve < burst:
        raise ConfigError(f"reserve must be between 0 and burst-1 (got {reserve}, burst {burst})")


def check_tenant(tenant: str, rate: float, burst: int) -> None:
    if not tenant:
        raise ConfigError("a tenant limit needs a tenant id (or '*' for the default)")
    if tenant != "*":
        _checked_tenant_id(tenant, "nor '*': no send could ever be held to this limit")
    _check_rate("tenant", rate, burst)


def _checked_tenant_id(tenant: str, consequence: str) -> str:
    try:
        return check_tenant_id(tenant)
    except SendValidationError:
        raise ConfigError(f"{tenant[:80]!r} is not a tenant id (1 to 64 ASCII letters, digits, '_' or '-'), "
                          f"{consequence}") from None


CHANGE_ATTEMPTS = 10
INGEST_QUOTA_PREFIX = "ingest-"  # the ingest quotas' names (ingest/quotas.py): buckets that limit tenants only
# KEYS[1] a provider's limits (hash)   ARGV[1] JSON {field: value as text}: what the change was checked against
# ARGV[2] JSON [field, ...] to delete   ARGV[3..] field, value pairs to write. Written only while the hash holds
# exactly what was read: 1, else 0.
_SET_IF_UNCHANGED = """
local expected = cjson.decode(ARGV[1])
local held = redis.call('HGETALL', KEYS[1])
local left = 0
for _ in pairs(expected) do left = left + 1 end
for i = 1, #held, 2 do
  if expected[held[i]] ~= held[i + 1] then return 0 end
  left = left - 1
end
if left ~= 0 then return 0 end
local deleted = cjson.decode(ARGV[2])
if #deleted > 0 then redis.call('HDEL', KEYS[1], unpack(deleted)) end
if #ARGV > 2 then redis.call('HSET', KEYS[1], unpack(ARGV, 3)) end
return 1
"""

# The cool-down's time to live (ms; -2: none), and the key removed, in one step.
_END_COOL_DOWN = """
local ttl = redis.call('PTTL', KEYS[1])
redis.call('DEL', KEYS[1])
return ttl
"""


def _number(provider: str, field: str, held: bytes) -> float:
    """A limit field as Redis holds it: an integer; a rate may be a fraction (redis-py writes a float as its
    repr, which reads back exactly). Anything else (a value edited by hand) is refused naming it: a
    ConfigError holds what it limits, where a ValueError stopped the worker and every tenant of its lane."""
    value: float | None = None
    try:
        value = int(held)
    except ValueError:
        try:
            if _is_rate(field) and math.isfinite(rate := float(held)):
                value = rate
        except ValueError:
            pass
    # A rate of 0 would have the gate wait for ever, a negative one lift the limit: refused as no number is.
    rate, burst = _is_rate(field), _is_burst(field)
    if value is not None and (value > 0 if rate else value >= (1 if burst else 0)):
        return value
    kind = "a number above 0" if rate else "an integer of at least 1" if burst else "an integer of at least 0"
    raise ConfigError(f"the limits of provider {provider!r}: field {field!r} holds {held[:40]!r}, not "
                      f"{kind}; a change that sets it again mends it "
                      f"(`streams limits set --provider {provider}` with that field's option, or `streams limits "
                      "unset` for a tenant's own limit)")


def _is_burst(field: str) -> bool:
    return field.split(":", 1)[0].endswith("burst")


def _is_rate(field: str) -> bool:
    """`global_rate`, `tenant_rate:<tenant>` (by the name before the tenant: `tenant_burst:corporate` is no rate)."""
    return field.split(":", 1)[0].endswith("rate")


def _unset(provider: str, change: LimitChange, held: dict[str, float], malformed: dict[str, bytes]) -> list[str]:
    """The fields removing a tenant's own limit deletes (none when it has none: nothing to do)."""
    tenant = change.unset_tenant
    if tenant is None:
        return []
    if tenant == "*":
        raise ConfigError("the default limit ('*') can be changed, not removed: every tenant without a limit of its "
                          "own is held to it")
    _checked_tenant_id(tenant, "so it has no limit to remove")
    if tenant == change.tenant:
        raise ConfigError(f"a change either sets tenant {tenant!r}'s limit or removes it, not both")
    own = [f for f in (f"tenant_rate:{tenant}", f"tenant_burst:{tenant}") if f in held or f in malformed]
    for field in ("tenant_rate:*", "tenant_burst:*"):
        if own and field in malformed:
            _number(provider, field, malformed[field])  # the default is there, but no number
    if own and ("tenant_rate:*" not in held or "tenant_burst:*" not in held):
        # Without a default the tenant would have no limit at all: its sends held (a provider's gate), or its
        # ingest quota not enforced.
        raise ConfigError(f"tenant {tenant!r} would have no limit: there is no default ('*') to hold it to; set one "
                          "first (`streams limits set --tenant '*' --rate ... --burst ...`)")
    return own


def _default_for(tenant: str | None, deletes: list[str], held: dict[str, float]) -> dict[str, float]:
    """A tenant whose own limit was removed, as held to the default now (its bucket lives as long as a refill at
    the default takes: `_stretch_buckets`); nothing when no limit was removed."""
    if tenant is None or not deletes:
        return {}
    return {f"tenant_rate:{tenant}": held["tenant_rate:*"], f"tenant_burst:{tenant}": held["tenant_burst:*"]}


class AppliedLimits(NamedTuple):
    before: dict[str, float]
    after: dict[str, float]
    changed: bool = True  # False: the change had nothing to write (a tenant without a limit of its own to remove)


def cool_down_ended(provider: str, left: float, tenant: str | None = None) -> tuple[str, dict, dict]:
    """The audit record (what, before, after) of an operator ending `provider`'s cool-down (that of `tenant`'s
    own account there, when given) with `left` s left."""
    return cool_down_subject(provider, tenant), {"cool_down_left_s": round(left, 1)}, {"cool_down_left_s": 0}


def cool_down_subject(provider: str, tenant: str | None = None) -> str:
    """What the audit trail names a cool-down by."""
    return f"cooldown/{provider}" + (f"/{tenant}" if tenant else "")


class LimitStore:
    """`oplog` (the operator log) makes changes durable beyond Redis: every change is written there,
    acknowledged, before Redis. The processes' stores always have one; a store without one (tests
    that only set up limits) writes Redis alone.

    A change is checked against the limits it would produce and written compare-and-set: two operators
    changing one provider at once never leave limits neither checked (a reserve set against a burst the
    other lowered meanwhile), and the operator log's last word is what Redis holds."""

    def __init__(self, client: redis.Redis, namespace: str = "", oplog: OperatorLog | None = None):
        self.client = client
        self.keys = RedisKeys(namespace)
        self.oplog = oplog
        self._set_if_unchanged = client.register_script(_SET_IF_UNCHANGED)
        self._end_cool_down = client.register_script(_END_COOL_DOWN)

    def _cool_key(self, provider: str, tenant: str | None) -> str:
        """The shared account's cool-down, or (`tenant`) that of the tenant's own account at the provider."""
        if tenant is None:
            return self.keys.cool(provider)
        return self.keys.own_account_cool(provider, _checked_tenant_id(tenant, "so it has no own account"))

    def cool_down_left(self, provider: str, tenant: str | None = None) -> float:
        """Seconds left of `provider`'s cool-down (0: none; `tenant`: its own account's), by Redis's clock: the key
        outlives the moment it holds by a second (cooldown.lua)."""
        try:
            ttl_ms = self.client.pttl(self._cool_key(provider, tenant))
        except redis.RedisError as exc:
            raise StoreUnavailable(f"cannot read the provider cool-down ({exc})") from None
        return max(0.0, (ttl_ms - 1000) / 1000)

    def clear_cool_down(self, provider: str, tenant: str | None = None) -> float:
        """End `provider`'s cool-down now (`tenant`: its own account's; an operator's decision: its quota was
        raised); returns the seconds it had left, of the very key removed, by Redis's clock as `cool_down_left`
        (one script: a 429 landing meanwhile is either ended with it, and named, or set after it, and stays).
        Workers holding on it ask the gate again within seconds (COOL_DOWN_RECHECK_S)."""
        try:
            ttl_ms = self._end_cool_down(keys=[self._cool_key(provider, tenant)])
        except redis.RedisError as exc:
            raise StoreUnavailable(f"cannot end the provider cool-down ({exc})") from None
        return max(0.0, (int(ttl_ms) - 1000) / 1000)

    def apply(self, provider: str, change: LimitChange) -> AppliedLimits:
        """Validate a change against the current limits and write it: the limits it replaced (those its
        compare-and-set held, not an earlier read: a concurrent change is not this one's) and the new ones."""
        for _ in range(CHANGE_ATTEMPTS):
            current, raw, malformed = self._held(provider)
            writes = self._checked(provider, change, current, malformed)
            deletes = _unset(provider, change, current, malformed)
            # A field edited by hand into no number is mended by a change that sets it again (or removes it); any
            # other change is refused naming it, as a read of it is: the log would record limits Redis does not hold.
            for field in sorted(set(malformed) - set(writes) - set(deletes)):
                _number(provider, field, malformed[field])
            if not writes and not deletes:
                return AppliedLimits(current, current, changed=False)
            record = dict(sorted((k, v) for k, v in {**current, **writes}.items() if k not in deletes))
            written = write_through_log(self.oplog, f"limits/{provider}", record,
                                        partial(self._write, provider, raw, writes, deletes),
                                        lambda: self._logged_form(provider), kept_if_unknown=current or None,
                                        deletes=False)
            if written:
                self._stretch_buckets(provider, {**writes, **_default_for(change.unset_tenant, deletes, current)})
                try:
                    return AppliedLimits(current, self.show(provider))
                except StoreUnavailable:  # made; only the look at it failed
                    return AppliedLimits(current, record)
        raise StoreUnavailable(f"the limits of {provider!r} kept changing under this change ({CHANGE_ATTEMPTS} "
                               "attempts)")

    def _checked(self, provider: str, change: LimitChange, current: dict[str, float],
                 malformed: Mapping[str, bytes] = MappingProxyType({})) -> dict[str, float]:
        """The fields `change` writes, checked against the limits they would produce with `current` (a field it
        keeps that is no number, `malformed`, is refused naming it: kept as 0, or as missing, it would be changed
        without a word)."""
        writes: dict[str, float] = {}
        if change.global_rate is not None or change.global_burst is not None or change.reserve is not None:
            for name in ("global_rate", "global_burst", "reserve"):
                if getattr(change, name) is None and name in malformed:
                    _number(provider, name, malformed[name])
            rate = change.global_rate if change.global_rate is not None else current.get("global_rate")
            burst = change.global_burst if change.global_burst is not None else current.get("global_burst")
            reserve = change.reserve if change.reserve is not None else current.get("reserve", 0)
            if rate is None or burst is None:
                raise ConfigError(f"provider {provider!r} has no global limit yet: give both the global "
                                  "rate and the global burst")
            check_provider(rate, int(burst), int(reserve))
            writes.update(global_rate=normal_rate(rate), global_burst=burst, reserve=reserve)
        if change.tenant is not None or change.tenant_rate is not None or change.tenant_burst is not None:
            if change.tenant_rate is None or change.tenant_burst is None:
                raise ConfigError("a tenant limit needs the tenant, its rate and its burst")
            check_tenant(change.tenant or "", change.tenant_rate, change.tenant_burst)
            writes.update({f"tenant_rate:{change.tenant}": normal_rate(change.tenant_rate),
                           f"tenant_burst:{change.tenant}": change.tenant_burst})
            if provider.startswith(INGEST_QUOTA_PREFIX) and "global_rate" not in {**current, **writes}:
                # The quota's bucket script admits nothing without its global limit, which ingest reads as a
                # quota nobody set: the tenant quota would be accepted here and never enforced.
                raise ConfigError(f"ingest quota {provider!r} has no global limit: a tenant quota is enforced only "
                                  "with one; set the global rate and burst (high: quotas are per tenant) first, or "
                                  "in the same change")
        for name in ("concurrency", "pause_ms"):
            value = getattr(change, name)
            if value is not None:
                if not 0 <= value <= (10_000 if name == "concurrency" else 60_000):
                    raise ConfigError(f"{name} must be between 0 and {10_000 if name == 'concurrency' else 60_000} "
                                      f"(got {value}; 0 means {'the default' if name == 'concurrency' else 'none'})")
                writes[name] = value
        return writes

    def _stretch_buckets(self, provider: str, writes: dict[str, float]) -> None:
        """A bucket expires when it would be full again at the rate of its last admission (gate.lua): a rate
        lowered or a burst raised since makes that too early, and an idle bucket would come back full (a tenant's
        daily quota drained and lowered tenfold: full again after a day, not ten). The provider's global bucket
        and a named tenant's bucket are made to live at least as long as a refill from empty takes now (PEXPIRE
        GT: never shortened). The buckets a default ('*') change governs, and tenants' own-account global buckets,
        are not: finding them would scan the keyspace. Best effort once the limits are written: a bucket denied
        later is kept long enough by the gate itself."""
        k = self.keys
        stretched: list[tuple[str, float, float]] = []  # (bucket, rate, burst)
        if "global_rate" in writes:
            stretched.append((k.global_bucket(provider), writes["global_rate"], writes["global_burst"]))
        for field, rate in writes.items():
            tenant = field.removeprefix("tenant_rate:")
            if tenant != field and tenant != "*":
                stretched.append((k.tenant_bucket(provider, tenant), rate, writes[f"tenant_burst:{tenant}"]))
        if not stretched:
            return
        pipe = self.client.pipeline(transaction=False)
        for bucket, rate, burst in stretched:
            pipe.pexpire(bucket, int(min(math.ceil(burst * 1000 / rate), 1e15)) + 60_000, gt=True)
        try:
            pipe.execute()
        except redis.RedisError as exc:
            log.warning("the limits of %r are written, but the expiry of its buckets could not be lengthened to "
                        "match (%s): an idle bucket may come back full early", provider, exc)

    def _logged_form(self, provider: str) -> bytes | None:
        """What Redis holds for `provider`, as its operator-log record (JSON), or None. A field that is no number
        (edited by hand) is left out: the log keeps limits, and the change that mends it logs it."""
        held, _, _ = self._held(provider)
        return orjson.dumps(held) if held else None

    def set_provider(self, provider: str, rate: float, burst: int, reserve: int = 0) -> None:
        self.apply(provider, LimitChange(global_rate=rate, global_burst=burst, reserve=reserve))

    def set_tenant(self, provider: str, tenant: str, rate: float, burst: int) -> None:
        """`tenant='*'` sets the default for tenants without their own limit."""
        self.apply(provider, LimitChange(tenant=tenant, tenant_rate=rate, tenant_burst=burst))

    def show(self, provider: str) -> dict[str, float]:
        current, _, malformed = self._held(provider)
        for field, value in malformed.items():
            _number(provider, field, value)  # refused, naming it
        return current

    def _held(self, provider: str) -> tuple[dict[str, float], dict[str, str], dict[str, bytes]]:
        """What Redis holds for `provider`: the fields that read as numbers, every field as its text (what a
        compare-and-set expects), and the fields that are no number (edited by hand)."""
        try:
            raw = self.client.hgetall(self.keys.limits(provider))
        except redis.RedisError as exc:
            raise StoreUnavailable(f"cannot read the limits of {provider!r} ({exc})") from None
        current: dict[str, float] = {}
        malformed: dict[str, bytes] = {}
        for key, value in sorted(raw.items()):
            field = key.decode()
            try:
                current[field] = _number(provider, field, value)
            except ConfigError:
                malformed[field] = value
        return current, {k.decode(): v.decode("utf-8", "replace") for k, v in raw.items()}, malformed

    def _fields(self, provider: str, *fields: str) -> list[float | None]:
        """These fields of a provider's limits (None: not set), read alone: a worker asks for one tenant's limit
        every 10 s, where the whole hash holds every tenant's."""
        try:
            raw = self.client.hmget(self.keys.limits(provider), list(fields))
        except redis.RedisError as exc:
            raise StoreUnavailable(f"cannot read the limits of {provider!r} ({exc})") from None
        return [None if v is None else _number(provider, f, v) for f, v in zip(fields, raw, strict=True)]

    def tenant(self, provider: str, tenant: str) -> Limit:
        own_rate, own_burst, default_rate, default_burst = self._fields(
            provider, f"tenant_rate:{tenant}", f"tenant_burst:{tenant}", "tenant_rate:*", "tenant_burst:*")
        # Field by field, as the gate's script reads them.
        rate = own_rate if own_rate is not None else default_rate
        burst = own_burst if own_burst is not None else default_burst
        if rate is None or burst is None:
            raise ConfigError(f"no limit for tenant {tenant!r} at provider {provider!r} and no default ('*')")
        return Limit(rate, int(burst))

    def pacing(self, provider: str) -> Pacing:
        concurrency, pause_ms = self._fields(provider, "concurrency", "pause_ms")
        return Pacing(int(concurrency) if concurrency else None, int(pause_ms or 0))

    def _write(self, provider: str, held: dict[str, str], fields: dict[str, float],
               deletes: list[str] | tuple[str, ...] = ()) -> bool:
        """Write `fields` and delete `deletes` while Redis still holds `held` (every field's text; False: someone
        changed the limits meanwhile)."""
        pairs = [x for name, value in fields.items() for x in (name, value)]
        try:
            return bool(self._set_if_unchanged(keys=[self.keys.limits(provider)],
                                               args=[orjson.dumps(held), orjson.dumps(list(deletes)), *pairs]))
        except redis.RedisError as exc:
            raise StoreUnavailable(f"cannot write the limits of {provider!r} ({exc})") from None
