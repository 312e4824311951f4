"""What to do after a provider call: delivered, retry at a tier, or dead-letter. Pure code.

A 429 is delayed work, never a drop. `Retry-After` (delta-seconds or HTTP-date) is honoured by
choosing the first tier at least that long; without it the policy's schedule (itself a capped
exponential: 10 s, 1 m, 5 m ... 12 h) applies, with up to +20% jitter so a fleet does not wake up
together. Quota 429s are parked on a long tier, never hot-retried. 400/422 are permanent. A timeout
after the request may have been accepted is retried only under the same provider idempotency key.
"""

from __future__ import annotations

import email.utils
import re
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC
from importlib import resources
from pathlib import Path

from ..errors import ConfigError
from ..lanes import RETRY_TIERS
from ..providers.outcome import ProviderResult

JITTER = 0.2
PARK_AT_LEAST_S = 3600  # quota 429s wait at least an hour
DEFAULT_COOL_DOWN_S = 1.0  # a 429 without a usable Retry-After still holds the provider off this long
# A 429 asking for at most this long is waited out in the worker (behind the shared cool-down)
# instead of travelling through a retry tier; longer waits go to the tiers.
IN_PROCESS_BACKOFF_MAX_S = 5.0


@dataclass(frozen=True)
class RetryPolicy:
    name: str
    max_attempts: int
    max_age_s: int
    schedule: tuple[str, ...]


@dataclass(frozen=True)
class Delivered:
    pass


@dataclass(frozen=True)
class RetryAt:
    tier: str
    due_ms: int
    reason: str


@dataclass(frozen=True)
class DeadLetter:
    reason: str


Decision = Delivered | RetryAt | DeadLetter

_AGE = re.compile(r"^(\d+)([smhd])$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _age(raw: object, where: str) -> int:
    m = _AGE.match(raw) if isinstance(raw, str) else None
    if not m:
        raise ConfigError(f"{where}: field 'max_age' must look like '10m', '2h' or '1d', got {raw!r}")
    return int(m.group(1)) * _UNIT[m.group(2)]


def parse_policies(text: str, source: str) -> dict[str, RetryPolicy]:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    out = {}
    for name, raw in (doc.get("policy") or {}).items():
        where = f"{source}: policy '{name}'"
        extra = set(raw) - {"max_attempts", "max_age", "schedule"}
        if extra:
            raise ConfigError(f"{where}: unknown field(s) {sorted(extra)}")
        attempts = raw.get("max_attempts")
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise ConfigError(f"{where}: field 'max_attempts' must be an integer >= 1, got {attempts!r}")
        schedule = raw.get("schedule")
        if not isinstance(schedule, list) or not schedule:
            raise ConfigError(f"{where}: field 'schedule' must be a non-empty list of tiers")
        for tier in schedule:
            if tier not in RETRY_TIERS:
                raise ConfigError(f"{where}: field 'schedule': unknown tier {tier!r} "
                                  f"(tiers: {', '.join(RETRY_TIERS)})")
        out[name] = RetryPolicy(name, attempts, _age(raw.get("max_age"), where), tuple(schedule))
    if not out:
        raise ConfigError(f"{source}: no [policy.<name>] tables")
    return out


def unknown_policy(name: str, known: Iterable[str]) -> str:
    """The one message for a policy name that is not in the policy file."""
    return f"unknown policy {name!r} (known: {', '.join(sorted(known))})"


def load_policies(path: str | Path | None = None) -> dict[str, RetryPolicy]:
    """The policies file: `path`, else the packaged streams/retry/policies.toml."""
    if path:
        p = Path(path)
        try:
            return parse_policies(p.read_text(), str(p))
        except FileNotFoundError:
            raise ConfigError(f"{p}: retry policy file not found") from None
    text = resources.files(__package__).joinpath("policies.toml").read_text()
    return parse_policies(text, "streams/retry/policies.toml")


def parse_retry_after(value: str | None, now_ms: int) -> float | None:
    """Seconds to wait from a Retry-After header, or None when missing or malformed."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when is None:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, when.timestamp() - now_ms / 1000)


def cool_down_s(result: ProviderResult, now_ms: int) -> float | None:
    """How long every worker must hold off the provider after this answer (None: not a 429)."""
    if result.outcome not in ("throttled", "quota"):
        return None
    return parse_retry_after(result.retry_after, now_ms) or DEFAULT_COOL_DOWN_S


def wait_in_process(result: ProviderResult, now_ms: int) -> bool:
    """A short rate-limit 429: the request was not accepted, so its sends may simply wait in the
    worker behind the cool-down rather than go through a retry tier."""
    wait = cool_down_s(result, now_ms)
    return result.outcome == "throttled" and wait is not None and wait <= IN_PROCESS_BACKOFF_MAX_S


def _tier_at_least(seconds: float) -> str:
    for tier, delay in RETRY_TIERS.items():
        if delay >= seconds:
            return tier
    return next(reversed(RETRY_TIERS))


def decide(policy: RetryPolicy, attempt: int, created_ms: int, result: ProviderResult, now_ms: int,
           jitter: float, provider_idempotent: bool = True) -> Decision:
    """`attempt` is the attempt that just ran (1-based); `jitter` is a uniform draw in [0, 1)."""
    outcome = result.outcome
    if outcome == "delivered":
        return Delivered()
    if outcome == "rejected":
        return DeadLetter("permanent_error")
    if outcome == "unknown" and not provider_idempotent:
        return DeadLetter("unknown_outcome")  # to reconciliation: a fresh request could duplicate
    if attempt >= policy.max_attempts:
        return DeadLetter("retries_exhausted")
    tier = policy.schedule[min(attempt - 1, len(policy.schedule) - 1)]
    if outcome == "quota":
        tier = max(tier, _tier_at_least(PARK_AT_LEAST_S), key=RETRY_TIERS.__getitem__)
    elif outcome == "throttled":
        wait = parse_retry_after(result.retry_after, now_ms)
        if wait is not None:
            tier = max(tier, _tier_at_least(wait), key=RETRY_TIERS.__getitem__)
    delay_ms = int(RETRY_TIERS[tier] * 1000 * (1 + JITTER * jitter))
    due_ms = now_ms + delay_ms
    if due_ms - created_ms > policy.max_age_s * 1000:
        return DeadLetter("quota_exceeded" if outcome == "quota" else "too_old")
    reason = {"throttled": "rate_limited", "quota": "quota_exceeded", "unknown": "unknown_outcome",
              "auth": "auth_failed"}.get(outcome, "provider_unavailable")
    return RetryAt(tier, due_ms, reason)
