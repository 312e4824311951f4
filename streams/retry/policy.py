"""What to do after a provider call: delivered, retry at a tier, or dead-letter. Pure code.

A 429 is delayed work, never a drop. `Retry-After` (delta-seconds or HTTP-date) is honoured by
choosing the first tier at least that long (and the exact due time); without it the policy's
schedule (itself a capped exponential: 10 s, 1 m, 5 m ... 12 h) applies, with +-20% jitter so a
fleet does not wake up together. Quota 429s are parked on a long tier, never hot-retried. 400/422
are permanent. A timeout after the request may have been accepted is retried only under the same
provider idempotency key. A send older than its policy's `max_age` is never attempted again.

Policies are named per message class in a visible file (`policies.toml`), and checked when loaded:
each policy's `max_age` must cover the worst case of its own schedule, or its last attempts could
never happen. The same file routes a send that names no policy to one (`[routing]`).
"""

from __future__ import annotations

import email.utils
import fnmatch
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from ..durations import duration_s
from ..errors import ConfigError
from ..lanes import CATEGORIES, CHANNELS, LANES, RETRY_TIERS
from ..names import TopicNames
from ..providers.outcome import ProviderResult

JITTER = 0.2  # each delay is drawn from [0.8, 1.2] x the tier's delay
PARK_AT_LEAST_S = 3600  # quota 429s wait at least an hour
QUOTA_SPREAD, QUOTA_SPREAD_MAX_S = 0.05, 300.0  # quota-parked sends come back over 5% of the wait, 5 min at most
# The spread ends this far before a send's max age: a copy is read a moment after its due time, and one due on the
# max age itself would then be too old, though its ask fitted.
SPREAD_ENDS_BEFORE_MAX_AGE_S = 5.0
DEFAULT_COOL_DOWN_S = 1.0  # a 429 without a usable Retry-After still holds the provider off this long
# The longest wait a Retry-After is taken for: asked for longer, the provider is tried again after a day.
MAX_RETRY_AFTER_S = 24 * 3600.0
_DELAY_SECONDS = re.compile(r"[0-9]+")  # RFC 9110 delay-seconds
# A 429 asking for at most this long is waited out in the worker (behind the shared cool-down)
# instead of travelling through a retry tier; longer waits go to the tiers.
IN_PROCESS_BACKOFF_MAX_S = 5.0
PACKAGED = "streams/retry/policies.toml"


@dataclass(frozen=True)
class RetryPolicy:
    name: str
    max_attempts: int
    max_age_s: int
    schedule: tuple[str, ...]

    def tier_after(self, attempt: int) -> str:
        """The tier that waits before attempt `attempt + 1` (the schedule's last tier repeats)."""
        return self.schedule[min(attempt - 1, len(self.schedule) - 1)]

    def worst_case_s(self) -> float:
        """From creation to the last attempt when every delay draws the longest jitter."""
        return sum(RETRY_TIERS[self.tier_after(a)] * (1 + JITTER) for a in range(1, self.max_attempts))


@dataclass(frozen=True)
class Delivered:
    pass


@dataclass(frozen=True)
class RetryAt:
    tier: str
    due_ms: int
    reason: str
    declined: bool = False  # a provider's 429: the attempt just made is not counted against the send's max_attempts


@dataclass(frozen=True)
class DeadLetter:
    reason: str
    declined: bool = False  # the attempt just made was a provider's 429 (its letter counts it as declined)


Decision = Delivered | RetryAt | DeadLetter

MIN_MAX_AGE_S = 60


def _age(raw: object, where: str) -> int:
    seconds = duration_s(raw)
    if seconds is None:
        raise ConfigError(f"{where}: field 'max_age' must look like '10m', '2h' or '1d', got {raw!r}")
    return seconds


def _policy(name: str, raw: dict, where: str) -> RetryPolicy:
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
            raise ConfigError(f"{where}: field 'schedule': unknown tier {tier!r} (tiers: {', '.join(RETRY_TIERS)})")
    policy = RetryPolicy(name, attempts, _age(raw.get("max_age"), where), tuple(schedule))
    if policy.max_age_s < MIN_MAX_AGE_S:  # a send would be too old before its first attempt, on any busy lane
        raise ConfigError(f"{where}: field 'max_age' ({raw.get('max_age')}) must be at least '1m': a send is "
                          "checked against it before every attempt, the first included")
    if policy.max_age_s < policy.worst_case_s():
        raise ConfigError(f"{where}: field 'max_age' ({raw.get('max_age')}) is shorter than the worst case of "
                          f"its own schedule: {attempts} attempts with +{JITTER:.0%} jitter take up to "
                          f"{policy.worst_case_s() / 3600:.1f} h, so its last attempts could never happen")
    return policy


def _doc(text: str, source: str) -> dict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None


def parse_policies(text: str, source: str) -> dict[str, RetryPolicy]:
    doc = _doc(text, source)
    out = {name: _policy(name, raw, f"{source}: policy '{name}'") for name, raw in (doc.get("policy") or {}).items()}
    if not out:
        raise ConfigError(f"{source}: no [policy.<name>] tables")
    return out


@dataclass(frozen=True)
class PolicyRouting:
    """How a send that names no policy gets one: its channel's default, else the first template rule
    that matches its template id (shell-style patterns), else its category's default."""

    categories: dict[str, str]
    channels: dict[str, str] = field(default_factory=dict)
    templates: tuple[tuple[str, str], ...] = ()

    def policy_for(self, channel: str, category: str, template_id: str) -> str:
        if channel in self.channels:
            return self.channels[channel]
        for pattern, policy in self.templates:
            if fnmatch.fnmatchcase(template_id, pattern):
                return policy
        return self.categories[category]


def parse_routing(text: str, source: str, policies: dict[str, RetryPolicy]) -> PolicyRouting:
    raw = _doc(text, source).get("routing") or {}
    where = f"{source}: [routing]"

    def known(name: object, fld: str) -> str:
        if not isinstance(name, str) or name not in policies:
            raise ConfigError(f"{where}: field '{fld}': {unknown_policy(str(name), policies)}")
        return name

    categories = {c: known(p, f"categories.{c}") for c, p in (raw.get("categories") or {}).items()}
    missing = set(CATEGORIES) - set(categories)
    if missing:
        raise ConfigError(f"{where}: field 'categories' needs a policy for {sorted(missing)}")
    channels = {c: known(p, f"channels.{c}") for c, p in (raw.get("channels") or {}).items()}
    for c in channels:
        if c not in CHANNELS:
            raise ConfigError(f"{where}: field 'channels': unknown channel {c!r}")
    templates = []
    for i, rule in enumerate(raw.get("templates") or []):
        if not isinstance(rule, dict) or not isinstance(rule.get("match"), str) or set(rule) != {"match", "policy"}:
            raise ConfigError(f"{where}: field 'templates[{i}]' must be {{match = \"pattern\", policy = \"name\"}}")
        templates.append((rule["match"], known(rule["policy"], f"templates[{i}].policy")))
    return PolicyRouting(categories, channels, tuple(templates))


def unknown_policy(name: str, known: Iterable[str]) -> str:
    """The one message for a policy name that is not in the policy file."""
    return f"unknown policy {name!r} (known: {', '.join(sorted(known))})"


def _read(path: str | Path | None) -> tuple[str, str]:
    if path:
        p = Path(path)
        try:
            return p.read_text(), str(p)
        except FileNotFoundError:
            raise ConfigError(f"{p}: retry policy file not found") from None
    return resources.files(__package__).joinpath("policies.toml").read_text(), PACKAGED


def load_policies(path: str | Path | None = None) -> dict[str, RetryPolicy]:
    """The policies file: `path`, else the packaged streams/retry/policies.toml."""
    return parse_policies(*_read(path))


RETENTION_ROOM_S = 24 * 3600  # what a policy's max age leaves of the retry tiers' retention: an outage's room


def check_within_retention(policies: dict[str, RetryPolicy], retention_ms: int, topic: str) -> None:
    """A copy may wait on a retry tier until its send's max age (a quota's reset, parked until it comes): a
    tier that deletes it sooner loses it silently, no dead letter, its status `retrying` for good. ConfigError
    for a policy whose max age leaves less than a day of `topic`'s retention (-1: kept for ever)."""
    if retention_ms < 0:
        return
    for policy in policies.values():
        if policy.max_age_s + RETENTION_ROOM_S > retention_ms / 1000:
            raise ConfigError(f"retry policy {policy.name!r}: field 'max_age' ({policy.max_age_s / 3600:.0f} h) "
                              f"leaves less than a day of {topic}'s retention ({retention_ms / 3_600_000:.0f} h): "
                              "a copy parked until its max age could be deleted before it is released")


def check_tiers_keep_copies(policies: dict[str, RetryPolicy], topics: Mapping[str, Any], names: TopicNames) -> None:
    """`check_within_retention` for each retry tier among `topics` (topic definitions, by name), as each defines
    its retention (none: the 7 days dispatch's definitions give every topic)."""
    for name in (names.retry(c, lane, tier) for c in CHANNELS for lane in LANES for tier in RETRY_TIERS):
        if name in topics:
            check_within_retention(policies, int(topics[name].config.get("retention.ms", "604800000")), name)


def load_routing(path: str | Path | None = None) -> PolicyRouting:
    text, source = _read(path)
    return parse_routing(text, source, parse_policies(text, source))


@cache
def default_routing() -> PolicyRouting:
    """The packaged file's routing (used where no other file was configured)."""
    return load_routing(None)


def expired(policy: RetryPolicy, created_ms: int, now_ms: int) -> bool:
    """A send older than its policy allows is never attempted again."""
    return now_ms - created_ms > policy.max_age_s * 1000


def parse_retry_after(value: str | None, now_ms: int) -> float | None:
    """Seconds to wait from a Retry-After header (at most MAX_RETRY_AFTER_S), or None when missing or
    malformed. The header comes from outside (a provider, a tenant's receiver): no value of it may
    raise, or yield a wait that overflows a due time."""
    if not value:
        return None
    value = value.strip()
    if _DELAY_SECONDS.fullmatch(value):  # ASCII digits only: str.isdigit() also takes '²', which float() refuses
        digits = value.lstrip("0") or "0"  # `0000000030` is 30 s, not a number too long to read
        return float(MAX_RETRY_AFTER_S) if len(digits) > 9 else float(min(int(digits), MAX_RETRY_AFTER_S))
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when is None:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return min(MAX_RETRY_AFTER_S, max(0.0, when.timestamp() - now_ms / 1000))


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


def tier_at_least(seconds: float) -> str:
    """The shortest tier at least `seconds` long (the longest tier when none is)."""
    for tier, delay in RETRY_TIERS.items():
        if delay >= seconds:
            return tier
    return next(reversed(RETRY_TIERS))


def decide(policy: RetryPolicy, attempt: int, created_ms: int, result: ProviderResult, now_ms: int,
           jitter: float, provider_idempotent: bool = True, time_scale: float = 1.0,
           first_copy_unknown: bool = False, throttle_is_attempt: bool = False, declined_before: int = 0) -> Decision:
    """`attempt` is the attempt that just ran (1-based); `jitter` is a uniform draw in [0, 1).
    `declined_before`: how many of the attempts before it a provider declined with a 429. They count toward neither
    the send's max_attempts nor, after a real failure, its schedule's next tier; a 429's own wait still follows every
    attempt made (a provider that keeps declining is asked less and less often, as before).
    `time_scale` shrinks the tiers' delays for tests that walk a whole schedule (1.0 in production).
    `first_copy_unknown`: this attempt re-sent a request whose first copy's fate is unknown.
    `throttle_is_attempt`: a 429 counts as an attempt (a webhook receiver's: the tenant's own server, which a
    delivery gives its schedule of attempts; a provider's 429 only says the shared account is busy)."""
    outcome = result.outcome
    # A send given up on that the provider may hold (this answer unknown, or an earlier copy's) is dead-lettered
    # `unknown_outcome`, whatever else ended it: replaying it blindly could deliver it twice.
    may_be_delivered = outcome == "unknown" or first_copy_unknown
    if outcome == "delivered":
        return Delivered()
    if outcome == "rejected":  # this copy refused; an earlier copy of the request may have been accepted
        return DeadLetter("unknown_outcome" if first_copy_unknown else "permanent_error")
    if outcome == "gone":  # the endpoint is disabled by it, which its tenant's alert says
        return DeadLetter("endpoint_gone")
    if outcome == "unknown" and not provider_idempotent:
        return DeadLetter("unknown_outcome")  # to reconciliation: a fresh request could duplicate
    # A provider's 429 is the provider declining to look at the request, not a failed attempt: it never uses up
    # the last one (a send throttled at its last attempt waits again; only its max age ends it).
    declined = outcome in ("throttled", "quota") and not throttle_is_attempt
    tries = attempt - min(max(0, declined_before), attempt - 1)  # this attempt and the earlier ones not declined
    if tries >= policy.max_attempts and not declined:
        return DeadLetter("unknown_outcome" if may_be_delivered else "retries_exhausted")
    # The earliest moment the next attempt may happen: what the provider asked for, at least (a 429 without a
    # usable ask: the cool-down the provider is held off for). Any other answer's ask (a 503 in maintenance) is
    # advice: kept when it fits the send's max age, else the schedule goes on (the maintenance may end sooner).
    deadline_ms = created_ms + policy.max_age_s * 1000
    asked = parse_retry_after(result.retry_after, now_ms) or 0.0
    advised = asked if now_ms + asked * 1000 <= deadline_ms else 0.0
    at_least = {"quota": max(PARK_AT_LEAST_S, asked), "throttled": asked or DEFAULT_COOL_DOWN_S}.get(outcome, advised)
    # Past its attempts (a 429 at the last one) a send has no next tier of its schedule: it waits for what the
    # provider asked, at least the shortest tier.
    counted = attempt if declined else tries
    scheduled = policy.tier_after(counted) if counted < policy.max_attempts else next(iter(RETRY_TIERS))
    tier = max(scheduled, tier_at_least(at_least), key=RETRY_TIERS.__getitem__)
    delay_ms = int(RETRY_TIERS[tier] * 1000 * (1 + JITTER * (2 * jitter - 1)) * time_scale)
    if outcome == "quota" or ((outcome == "throttled" or advised) and now_ms + delay_ms > deadline_ms):
        # Due when the provider asked (a quota's reset; or a throttled or advised ask whose tier, its ask or its
        # schedule's next rounded up, would come past the send's max age: an ask that fits never ends a send). The tier
        # is only the topic that holds it (the retrier releases by the due time); spread over a little after the
        # ask, or, for a quota, at the schedule's next tier when that is later.
        delay_ms = int(RETRY_TIERS[scheduled] * 1000 * (1 + JITTER * (2 * jitter - 1)) * time_scale
                       ) if outcome == "quota" else 0
        # The spread never pushes past the send's max age an ask that falls within it.
        room_s = max(0.0, (deadline_ms - now_ms) / 1000 - at_least - SPREAD_ENDS_BEFORE_MAX_AGE_S)
        at_least += jitter * min(QUOTA_SPREAD * at_least, QUOTA_SPREAD_MAX_S, room_s)
    due_ms = now_ms + max(delay_ms, int(at_least * 1000))
    if due_ms > deadline_ms:
        return DeadLetter("unknown_outcome" if may_be_delivered else "quota_exceeded" if outcome == "quota"
                          else "too_old", declined)
    reason = {"throttled": "rate_limited", "quota": "quota_exceeded", "unknown": "unknown_outcome",
              "auth": "auth_failed"}.get(outcome, "provider_unavailable")
    return RetryAt(tier, due_ms, reason, declined)
