"""Every environment variable the project reads, parsed once into frozen dataclasses.

No other module reads `os.environ`. A bad value raises ConfigError naming the variable and what
was expected. The variables and their defaults:

    KAFKA_BOOTSTRAP_SERVERS       Kafka bootstrap servers  (default: local stack, 127.0.0.1:DUAL_RAIL_KAFKA_PORT)
    REDIS_URL                     Redis URL     (default: local stack, redis://127.0.0.1:DUAL_RAIL_REDIS_PORT/0;
                                  a Redis Cluster: redis+cluster://host:port[,host:port...])
    DUAL_RAIL_HOME                local stack cache and data    (default: ~/.cache/dual-rail)
    DUAL_RAIL_KAFKA_PORT          local Kafka port              (default: 19092; the controller uses the next port)
    DUAL_RAIL_REDIS_PORT          local Redis port              (default: 16379)
    DUAL_RAIL_TOPIC_NAMESPACE     prefix of every topic, group and Redis key name (default: none)
    DUAL_RAIL_TOPIC_PROFILE       topic replication profile: dev (1 replica) or cluster (3 replicas,
                                  min.insync.replicas 2) (default: none: as topics/*.toml say)
    DUAL_RAIL_PROVIDERS           provider file  (default: the packaged streams/providers/providers.toml)
    RESEND_BASE_URL, SMS_BASE_URL provider base URLs            (required by the workers of that channel)
    RESEND_API_KEYS, SMS_API_KEYS provider API keys, JSON {tenant: key}; "*" is the default key
    SMS_B_BASE_URL                the second SMS provider (optional: without it, SMS has no fallback)
    SMS_B_CREDENTIALS             its client credentials for the token endpoint, JSON {"client_id", "client_secret"}
    PROVIDER_TIMEOUT_S            provider request timeout, seconds (default: 10)
    PROVIDER_AUTH_HOLD_S          how long a provider (or a tenant's key) is held after a 401 a fresh token or key
                                  did not cure, seconds (default: 30)
    DUAL_RAIL_RETRY_POLICIES      retry policy file             (default: the packaged streams/retry/policies.toml)
    DUAL_RAIL_RETRY_TIME_SCALE    tests only: multiplies every retry tier's delay (default: 1)
    YIELD_PAUSE_ABOVE             transactional lag (messages) at which marketing yields (default: 100)
    YIELD_RESUME_BELOW            ... and at or below which it resumes (default: 20)
    YIELD_PAUSE_ABOVE_SECONDS     also yield when the oldest transactional message is this old (default: 0, off)
    YIELD_RESUME_BELOW_SECONDS    ... and resume only when it is at most this old (default: half of the above)
    YIELD_MIN_DWELL_S             shortest pause, seconds (default: 2)
    YIELD_STALE_AFTER_S           a lag reading older than this is not trusted, seconds (default: 3)
    DUAL_RAIL_COMMIT_INTERVAL_MS  how often consumers commit stored offsets (default: 1000)
    DUAL_RAIL_MARKETING_NICE      the CPU priority marketing workers and retriers give up, nice 0-19 (default: 10)
    DUAL_RAIL_INGEST_BULK         process: the ingest API serves batches in a bulk process of its own; off: in
                                  the API process (default: process)
    DUAL_RAIL_INGEST_BULK_NICE    the bulk process's nice value, 0-19 (default: 10)
    DUAL_RAIL_INGEST_INSTANCE     names the bulk process's transactional producers: unique per API process, the
                                  same after a restart (default: hostname-pid)
    KAFKA_DELIVERY_TIMEOUT_MS     how long a record may wait for the broker's acknowledgement before it is
                                  reported failed and produced again (default: 60000)
    WEBHOOK_REQUIRE_HTTPS         1: endpoint URLs must use https (default: 1; tests and the demo set 0)
    WEBHOOK_ALLOW_HOSTS           hosts or addresses exempt from the SSRF address rules, comma-separated (default: none)
    WEBHOOK_TIMEOUT_S             total time a webhook attempt may take (default: 10)
    WEBHOOK_ENDPOINT_CONCURRENCY  deliveries in flight per healthy endpoint (default: 20; a failing one gets 1)
    WEBHOOK_BACKLOG_MAX_COUNT     backlog shedding: new events for an endpoint are skipped while it has at least
                                  this many undelivered deliveries ... (default: 10000)
    WEBHOOK_BACKLOG_MAX_AGE_S     ... and the oldest of them is at least this old, seconds (default: 21600, 6 h)
    WEBHOOK_SECRET_KEYS           keys that seal endpoints' signing secrets at rest, `id:base64-32-bytes,...`: the
                                  first seals, all open (default: unset, secrets stored in the clear)
    ALERTS_TENANT                 the tenant endpoint alert emails are sent as (default: dual-rail)
    ALERTS_FROM                   their sender    (default: Dual-rail webhooks <alerts@dual-rail.dev>)
    SENDER_DOMAINS                the domains each tenant may send email from, JSON {tenant: [domain, ...]}, "*"
                                  for tenants not named; subdomains included (default: unset, any sender: set it
                                  wherever tenants share a provider account)
    DUAL_RAIL_STAGE_LOG           benchmarks only: a file where lane workers write each delivered send's stage timings
    LOG_LEVEL                     Python log level              (default: INFO)
    LOG_FORMAT                    text or json                  (default: text; `streams --log-format` overrides)
    METRICS_ADDR                  address /metrics binds to     (default: 127.0.0.1)
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import urlsplit

import orjson

from .errors import ConfigError, SendValidationError
from .ingest.senders import SenderDomains
from .lag.yield_policy import YieldPolicy
from .names import RedisKeys, TopicNames
from .providers.registry import Registry, load_registry
from .topology.spec import PROFILES

if TYPE_CHECKING:
    from .webhooks.sealing import Sealer

DEFAULT_KAFKA_PORT = 19092
DEFAULT_REDIS_PORT = 16379
T = TypeVar("T")


def _parse(environ: Mapping[str, str], name: str, default: T, parse: Callable[[str], T], expected: str) -> T:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return parse(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not valid: expected {expected}") from None


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    return _parse(environ, name, default, int, "an integer")


def _int_in(environ: Mapping[str, str], name: str, default: int, low: int, high: int | None = None,
            why: str = "") -> int:
    value = _int(environ, name, default)
    if value < low or (high is not None and value > high):
        bounds = f"from {low} to {high}" if high is not None else f"at least {low}"
        raise ConfigError(f"environment variable {name}={value} must be {bounds}{why}")
    return value


def is_duration(seconds: float, may_be_zero: bool = False) -> bool:
    """Whether a number of seconds is one the settings and role options take: finite, above 0 (or 0 too)."""
    return math.isfinite(seconds) and (seconds > 0 or (may_be_zero and seconds == 0))


def _seconds(environ: Mapping[str, str], name: str, default: float, may_be_zero: bool = False) -> float:
    value = _float(environ, name, default)
    if not is_duration(value, may_be_zero):
        raise ConfigError(f"environment variable {name}={value} must be a number of seconds "
                          f"{'from 0' if may_be_zero else 'above 0'}")
    return value


def _nice(environ: Mapping[str, str], name: str) -> int:
    value = _int(environ, name, 10)
    if not 0 <= value <= 19:
        raise ConfigError(f"environment variable {name}={value} must be from 0 to 19 (a nice value)")
    return value


def _bulk_nice(environ: Mapping[str, str]) -> int | None:
    if _choice(environ, "DUAL_RAIL_INGEST_BULK", "process", ("process", "off")) == "off":
        return None
    return _nice(environ, "DUAL_RAIL_INGEST_BULK_NICE")


def _instance(environ: Mapping[str, str]) -> str | None:
    value = environ.get("DUAL_RAIL_INGEST_INSTANCE") or None
    if value is not None and not re.fullmatch(r"[A-Za-z0-9._-]{1,100}", value):
        raise ConfigError(f"environment variable DUAL_RAIL_INGEST_INSTANCE={value!r} must be 1-100 letters, digits, "
                          "'.', '_' or '-' (it names the API instance's transactional producers)")
    return value


def _float(environ: Mapping[str, str], name: str, default: float) -> float:
    return _parse(environ, name, default, float, "a number")


def _optional_float(environ: Mapping[str, str], name: str) -> float | None:
    return _parse(environ, name, None, float, "a number")


def _log_level(environ: Mapping[str, str]) -> str:
    """LOG_LEVEL: a name `logging` knows (`WARN`, `NOTSET` too), in any case (`debug` is `DEBUG`)."""
    levels = logging.getLevelNamesMapping()
    value = environ.get("LOG_LEVEL") or "INFO"
    if value.strip().upper() not in levels:
        raise ConfigError(f"environment variable LOG_LEVEL={value!r} is not valid: expected one of "
                          f"{', '.join(sorted(levels, key=levels.__getitem__))}")
    return value.strip().upper()


def _choice(environ: Mapping[str, str], name: str, default: str, choices: tuple[str, ...]) -> str:
    value = environ.get(name) or default
    if value not in choices:
        raise ConfigError(f"environment variable {name}={value!r} is not valid: expected one of {', '.join(choices)}")
    return value


def _topic_profile(environ: Mapping[str, str]) -> str | None:
    value = environ.get("DUAL_RAIL_TOPIC_PROFILE") or None
    if value is not None and value not in PROFILES:
        raise ConfigError(f"environment variable DUAL_RAIL_TOPIC_PROFILE={value!r} is not valid: expected one of "
                          f"{', '.join(PROFILES)}")
    return value


def _api_keys(environ: Mapping[str, str], name: str) -> dict[str, str]:
    raw = environ.get(name) or ""
    try:
        keys = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError:
        keys = None
    if not isinstance(keys, dict) or not all(isinstance(v, str) and v for v in keys.values()):
        raise ConfigError(f"environment variable {name} must be a JSON object of strings (API keys: "
                          "{tenant: key}; token credentials: {client_id, client_secret})")
    return keys


def _tenant(environ: Mapping[str, str], name: str, default: str) -> str:
    from .send import check_tenant_id

    value = environ.get(name) or default
    try:
        return check_tenant_id(value)
    except SendValidationError:
        raise ConfigError(f"environment variable {name}={value!r} is not valid: expected 1 to 64 ASCII letters, "
                          "digits, '_' or '-'") from None


def _sender_domains(environ: Mapping[str, str]) -> SenderDomains:
    raw = environ.get("SENDER_DOMAINS") or ""
    if not raw:
        return SenderDomains()
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        doc = None
    return SenderDomains.parse(doc, "environment variable SENDER_DOMAINS")


def _secret_keys(environ: Mapping[str, str]) -> Sealer | None:
    from .webhooks.sealing import Sealer

    try:
        return Sealer.parse(environ.get("WEBHOOK_SECRET_KEYS") or "", "environment variable WEBHOOK_SECRET_KEYS")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _sender(environ: Mapping[str, str], name: str, default: str) -> str:
    from .send import check_address

    value = environ.get(name) or default
    try:
        return check_address(value)
    except ValueError:
        raise ConfigError(f"environment variable {name} is not valid: expected an email address "
                          "('name@host' or 'Name <name@host>')") from None


@dataclass(frozen=True)
class StackConfig:
    """Where Kafka and Redis are. Explicit addresses win over the local stack."""

    home: Path
    kafka_bootstrap: str | None
    redis_url: str | None = field(repr=False)  # may hold a password
    kafka_port: int = DEFAULT_KAFKA_PORT
    redis_port: int = DEFAULT_REDIS_PORT

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> StackConfig:
        e = os.environ if environ is None else environ
        return cls(
            home=Path(e.get("DUAL_RAIL_HOME") or Path.home() / ".cache" / "dual-rail"),
            kafka_bootstrap=e.get("KAFKA_BOOTSTRAP_SERVERS") or None,
            redis_url=e.get("REDIS_URL") or None,
            kafka_port=_int(e, "DUAL_RAIL_KAFKA_PORT", DEFAULT_KAFKA_PORT),
            redis_port=_int(e, "DUAL_RAIL_REDIS_PORT", DEFAULT_REDIS_PORT),
        )

    @property
    def bootstrap(self) -> str:
        return self.kafka_bootstrap or f"127.0.0.1:{self.kafka_port}"

    @property
    def redis(self) -> str:
        return self.redis_url or f"redis://127.0.0.1:{self.redis_port}/0"


def _endpoints(registry: Registry, e: Mapping[str, str]) -> dict[str, ProviderEndpoint]:
    """Each provider's base URL and credentials from the environment variables its entry names."""
    out = {}
    for p in registry.providers.values():
        if p.auth == "none":
            continue
        keys = _api_keys(e, p.keys_env)
        if p.auth == "token" and keys and not {"client_id", "client_secret"} <= set(keys):
            raise ConfigError(f"environment variable {p.keys_env} must hold client_id and client_secret "
                              f"(provider {p.name!r} authenticates with a token)")
        out[p.name] = ProviderEndpoint(_base_url(e, p.base_url_env, p.name), keys)
    return out


_URL_USERINFO = re.compile(r".*@")
_URL_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:/+")
_URL_QUERY = re.compile(r"([?#]).*")


def _masked(url: str) -> str:
    """A URL as an error may show it: whatever comes before its last `@` but a scheme (a user and password, a
    token as the user, a password holding `@` or `/`), masked, and its query and fragment (`?api_key=...`),
    whether it parses or not (a scheme with one slash, or none, included)."""
    def userinfo(match: re.Match) -> str:
        scheme = _URL_SCHEME.match(match.group(0))
        return (scheme.group(0) if scheme else "") + "***@"

    return _URL_QUERY.sub(r"\1***", _URL_USERINFO.sub(userinfo, url, count=1))


def _base_url(e: Mapping[str, str], name: str, provider: str) -> str | None:
    """A provider's base URL: http(s), a host, and no path. The allowlist holds the provider's full paths
    (`/emails`), so under a prefix (`/v1`) every request would be refused and nothing ever sent."""
    raw = e.get(name) or None
    if raw is None:
        return None
    try:
        url = urlsplit(raw)
        url.port  # noqa: B018 (a port that is not a number raises here)
    except ValueError:
        url = None
    if url is None or url.scheme not in ("http", "https") or not url.hostname:
        raise ConfigError(f"{name}={_masked(raw)!r} (provider {provider!r}) must be an http(s) URL with a host")
    if url.path not in ("", "/") or url.query or url.fragment:
        # The URL is not shown whole: a path may hold a token as well as a query (`https://gw/bot123:SECRET`).
        raise ConfigError(f"{name} (provider {provider!r}) must name no path, query or fragment (it has one, not "
                          f"shown here): the provider's allowlisted paths are full paths from the host (give "
                          f"{_masked(f'{url.scheme}://{url.netloc}')!r})")
    return raw


@dataclass(frozen=True)
class ProviderEndpoint:
    """A provider's base URL and API keys per tenant (`*` is the default)."""

    base_url: str | None = field(repr=False)  # may carry a user and password
    api_keys: dict[str, str] = field(default_factory=dict, repr=False)


_NAMESPACE = re.compile(r"[A-Za-z0-9._-]{0,100}")


def _namespace(e: Mapping[str, str]) -> str:
    """The prefix of every topic name: what a topic name may hold (letters, digits, `.`, `_`, `-`)."""
    value = e.get("DUAL_RAIL_TOPIC_NAMESPACE", "")
    if not _NAMESPACE.fullmatch(value):
        raise ConfigError(f"environment variable DUAL_RAIL_TOPIC_NAMESPACE={value[:120]!r} must be at most 100 "
                          "letters, digits, '.', '_' or '-' (it prefixes every topic name)")
    return value


def _yield_policy(e: Mapping[str, str]) -> YieldPolicy:
    try:
        return YieldPolicy(pause_above=_int(e, "YIELD_PAUSE_ABOVE", 100),
                           resume_below=_int(e, "YIELD_RESUME_BELOW", 20),
                           pause_above_seconds=_float(e, "YIELD_PAUSE_ABOVE_SECONDS", 0.0),
                           resume_below_seconds=_optional_float(e, "YIELD_RESUME_BELOW_SECONDS"),
                           min_dwell_s=_float(e, "YIELD_MIN_DWELL_S", 2.0),
                           stale_after_s=_float(e, "YIELD_STALE_AFTER_S", 3.0))
    except ValueError as exc:
        raise ConfigError(f"environment variable {exc}") from None  # the policy's error names its variable


@dataclass(frozen=True)
class Config:
    stack: StackConfig
    namespace: str = ""
    topic_profile: str | None = None  # a name of topology.spec.PROFILES; None: the definitions as written
    providers: dict[str, ProviderEndpoint] = field(default_factory=dict)  # by provider name
    providers_path: str | None = None
    provider_timeout_s: float = 10.0
    provider_auth_hold_s: float = 30.0
    retry_policies_path: str | None = None
    retry_time_scale: float = 1.0
    yield_policy: YieldPolicy = field(default_factory=YieldPolicy)
    commit_interval_ms: int = 1000
    delivery_timeout_ms: int = 60_000
    webhook_require_https: bool = True
    webhook_allow_hosts: frozenset[str] = frozenset()
    webhook_timeout_s: float = 10.0
    webhook_endpoint_concurrency: int = 20
    webhook_backlog_max_count: int = 10_000
    webhook_backlog_max_age_s: float = 21_600.0
    webhook_secret_keys: Sealer | None = field(default=None, repr=False)  # keys: never in a repr or a log
    marketing_nice: int = 10  # CPU priority the marketing lane's roles give up (nice), 0..19
    ingest_bulk_nice: int | None = 10  # the ingest API's bulk process's nice value; None: batches served in-process
    ingest_instance: str | None = None  # names the bulk process's transactional ids; None: hostname-pid
    alerts_tenant: str = "dual-rail"
    alerts_from: str = "Dual-rail webhooks <alerts@dual-rail.dev>"
    sender_domains: SenderDomains = field(default_factory=SenderDomains)
    stage_log_path: str | None = None
    log_level: str = "INFO"
    log_format: str = "text"
    metrics_addr: str = "127.0.0.1"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Config:
        e = os.environ if environ is None else environ
        return cls(
            stack=StackConfig.from_env(e),
            namespace=_namespace(e),
            topic_profile=_topic_profile(e),
            providers_path=e.get("DUAL_RAIL_PROVIDERS") or None,
            providers=_endpoints(load_registry(e.get("DUAL_RAIL_PROVIDERS") or None), e),
            provider_timeout_s=_seconds(e, "PROVIDER_TIMEOUT_S", 10.0),
            provider_auth_hold_s=_seconds(e, "PROVIDER_AUTH_HOLD_S", 30.0, may_be_zero=True),
            retry_policies_path=retry_policies_path(e),
            retry_time_scale=_seconds(e, "DUAL_RAIL_RETRY_TIME_SCALE", 1.0),
            yield_policy=_yield_policy(e),
            # 0 would turn the consumers' commits off (librdkafka), and the lag, read from committed offsets, would
            # only grow: marketing paused for good.
            commit_interval_ms=_int_in(e, "DUAL_RAIL_COMMIT_INTERVAL_MS", 1000, 1,
                                       why=" (ms: 0 turns commits off, and the lanes' lag is read from them)"),
            delivery_timeout_ms=_int_in(e, "KAFKA_DELIVERY_TIMEOUT_MS", 60_000, 1000, why=" (ms)"),
            webhook_require_https=_choice(e, "WEBHOOK_REQUIRE_HTTPS", "1", ("0", "1")) == "1",
            webhook_allow_hosts=frozenset(h.strip() for h in (e.get("WEBHOOK_ALLOW_HOSTS") or "").split(",")
                                          if h.strip()),
            webhook_timeout_s=_seconds(e, "WEBHOOK_TIMEOUT_S", 10.0),
            webhook_endpoint_concurrency=_int_in(e, "WEBHOOK_ENDPOINT_CONCURRENCY", 20, 1),
            webhook_backlog_max_count=_int_in(e, "WEBHOOK_BACKLOG_MAX_COUNT", 10_000, 1),
            webhook_backlog_max_age_s=_seconds(e, "WEBHOOK_BACKLOG_MAX_AGE_S", 21_600.0, may_be_zero=True),
            webhook_secret_keys=_secret_keys(e),
            marketing_nice=_nice(e, "DUAL_RAIL_MARKETING_NICE"),
            ingest_bulk_nice=_bulk_nice(e),
            ingest_instance=_instance(e),
            alerts_tenant=_tenant(e, "ALERTS_TENANT", "dual-rail"),
            alerts_from=_sender(e, "ALERTS_FROM", "Dual-rail webhooks <alerts@dual-rail.dev>"),
            sender_domains=_sender_domains(e),
            stage_log_path=e.get("DUAL_RAIL_STAGE_LOG") or None,
            log_level=_log_level(e),
            log_format=_choice(e, "LOG_FORMAT", "text", ("text", "json")),
            metrics_addr=e.get("METRICS_ADDR") or "127.0.0.1",
        )

    @property
    def bootstrap(self) -> str:
        return self.stack.bootstrap

    @property
    def redis_url(self) -> str:
        return self.stack.redis

    @property
    def registry(self) -> Registry:
        return load_registry(self.providers_path)

    @property
    def names(self) -> TopicNames:
        return TopicNames(self.namespace)

    @property
    def keys(self) -> RedisKeys:
        return RedisKeys(self.namespace)


def retry_policies_path(environ: Mapping[str, str] | None = None) -> str | None:
    """DUAL_RAIL_RETRY_POLICIES (None: the packaged file), for the SDK, which has no Config of its own."""
    return (os.environ if environ is None else environ).get("DUAL_RAIL_RETRY_POLICIES") or None
