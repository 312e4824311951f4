"""The providers, as data: `providers.toml` (or the file `DUAL_RAIL_PROVIDERS` names), validated
when it is loaded; an error names the provider and the field. Pure code (adapters are imported
when built).

The worker, the runtime, the configuration and the CLI all read this table.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import import_module
from pathlib import Path
from typing import Any

from ..durations import duration_s
from ..errors import ConfigError
from ..lanes import CHANNELS, LANES

AUTH_KINDS = ("api_key", "token", "none")
DEFAULT_FILE = Path(__file__).with_name("providers.toml")
MAX_CONCURRENCY = 1024  # a provider's requests in flight per worker (webhooks: 1,024 slow receivers)
DAY_S = 24 * 3600
MIN_WINDOW_S = 3600  # a shorter window leaves no time to re-send an unknown outcome through the retry tiers
# Sends stay claimed 7 days (CLAIM_TTL_MS): a request's record never outlives its claims, so a longer window is taken as
# 7 days (a record shorter than the provider's window is the safe side: the send goes to reconciliation sooner).
MAX_WINDOW_S = 7 * DAY_S


@dataclass(frozen=True)
class ProviderSpec:
    name: str                # the gate's bucket key and the metrics label
    channel: str
    adapter: str             # "module:Class" of the protocol's adapter
    base_url_env: str = ""   # environment variable holding the base URL
    auth: str = "api_key"    # api_key | token | none
    keys_env: str = ""       # api_key: JSON {tenant: key}; token: JSON {"client_id", "client_secret"}
    token_path: tuple[str, str] | None = None  # token auth: (method, path) of the token endpoint
    paths: frozenset[tuple[str, str]] = frozenset()
    batch_lanes: frozenset[str] = field(default_factory=frozenset)
    batch_max: int = 1
    # How long the provider keeps an Idempotency-Key (0: it does not honour them): an unknown outcome is re-sent
    # under the same key only while it does.
    idempotency_window_s: int = DAY_S
    shared_limit: bool = True  # one limit for all our traffic (a 429 holds every worker off it)
    concurrency: int = 8     # requests in flight per worker, at most
    fallback_errors: frozenset[str] = frozenset()

    @property
    def idempotent(self) -> bool:
        return self.idempotency_window_s > 0

    @property
    def record_ttl_ms(self) -> int:
        """How long a request's body is kept to be re-sent under its key: inside the provider's window by a 24th of
        it (an hour of a day), so that a re-send started as the record ends, or on a promoted replica whose clock
        runs behind, still reaches the provider while it keeps the key. At a provider without keys, as for a day's
        window: its body is never re-sent, but the record still guards a release against freeing a newer claim."""
        return (self.idempotency_window_s or DAY_S) * 1000 * 23 // 24

    @property
    def allowed(self) -> frozenset[tuple[str, str]]:
        """Every (method, path) a request to this provider may use."""
        return self.paths | ({self.token_path} if self.token_path else set())


@dataclass(frozen=True)
class Registry:
    providers: dict[str, ProviderSpec]
    channels: dict[str, tuple[str, ...]]   # channel -> provider names, in fallback order

    def for_channel(self, channel: str) -> list[ProviderSpec]:
        names = self.channels.get(channel)
        if not names:
            raise ConfigError(f"no provider for channel {channel!r} (have: {', '.join(self.channels)})")
        return [self.providers[n] for n in names]

    def primary(self, channel: str) -> ProviderSpec:
        return self.for_channel(channel)[0]

    def with_cool_down(self) -> list[str]:
        """The providers a 429 holds as a whole (shared_limit): those an operator may end a cool-down of. Not
        the webhook provider, whose 429s hold only the endpoint that answered."""
        return sorted(name for name, spec in self.providers.items() if spec.shared_limit)


def _path(where: str, value: Any) -> tuple[str, str]:
    method, _, path = str(value).partition(" ")
    if method not in ("GET", "POST", "PUT", "PATCH", "DELETE") or not path.startswith("/"):
        raise ConfigError(f"{where}: {value!r} is not 'METHOD /path'")
    return method, path


def _provider(where: str, doc: dict) -> ProviderSpec:
    def need(key: str, kind: type) -> Any:
        if not isinstance(doc.get(key), kind):
            raise ConfigError(f"{where}: field {key!r} must be a {kind.__name__}")
        return doc[key]

    def flag(key: str) -> bool:
        """Read as written: `shared_limit = "false"` (a string) must not read as true."""
        value = doc.get(key, True)
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: field {key!r} must be true or false (got {value!r})")
        return value

    def window() -> int:
        """Required, never assumed: a provider taken to honour keys it ignores is sent an unknown outcome again
        (delivered twice), and one that keeps them less long than assumed gets a re-send after it forgot."""
        value = doc.get("idempotency_window")
        if value == "none":
            return 0
        seconds = duration_s(value)
        if seconds is None or seconds < MIN_WINDOW_S:
            raise ConfigError(f"{where}: field 'idempotency_window' is required: how long the provider keeps an "
                              "Idempotency-Key, an hour or more ('24h', '7d'; a longer window counts as 7 days), "
                              f"or 'none' when it does not honour them (got {value!r})")
        return min(seconds, MAX_WINDOW_S)

    def strings(key: str) -> list[str]:
        value = doc.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: field {key!r} must be a list of strings (got {value!r})")
        return value

    def text(key: str) -> str:
        value = doc.get(key, "")
        if not isinstance(value, str):
            raise ConfigError(f"{where}: field {key!r} must be a string, the name of an environment variable")
        return value

    def count(key: str, default: int) -> int:
        value = doc.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{where}: field {key!r} must be an integer >= 1")
        return value

    name, channel, adapter = need("name", str), need("channel", str), need("adapter", str)
    where = f"{where} ({name})"
    known = set(ProviderSpec.__dataclass_fields__) - {"idempotency_window_s"} | {"idempotency_window"}
    if "idempotent" in doc:
        raise ConfigError(f"{where}: field 'idempotent' is now 'idempotency_window': how long the provider keeps an "
                          "Idempotency-Key ('24h'), or 'none'")
    if unknown := set(doc) - known:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    if channel not in CHANNELS:
        raise ConfigError(f"{where}: field 'channel': {channel!r} is not one of {', '.join(CHANNELS)}")
    if ":" not in adapter:
        raise ConfigError(f"{where}: field 'adapter': {adapter!r} is not 'module:Class'")
    base_url_env, keys_env = text("base_url_env"), text("keys_env")
    auth = doc.get("auth", "api_key")
    if auth not in AUTH_KINDS:
        raise ConfigError(f"{where}: field 'auth': {auth!r} is not one of {', '.join(AUTH_KINDS)}")
    if auth != "none" and not keys_env:
        raise ConfigError(f"{where}: field 'keys_env' is required for auth {auth!r}")
    if auth == "token" and not doc.get("token_path"):
        raise ConfigError(f"{where}: field 'token_path' is required for token auth")
    if auth != "none" and not base_url_env:
        raise ConfigError(f"{where}: field 'base_url_env' is required")
    lanes = frozenset(strings("batch_lanes"))
    if not lanes <= set(LANES):
        raise ConfigError(f"{where}: field 'batch_lanes': {sorted(lanes - set(LANES))} are not lanes")
    batch_max, concurrency = count("batch_max", 1), count("concurrency", 8)
    if concurrency > MAX_CONCURRENCY:
        # A transactional worker keeps this many requests in flight: as many threads and connections.
        raise ConfigError(f"{where}: field 'concurrency' must be at most {MAX_CONCURRENCY} (requests in flight "
                          f"per worker: one thread and one connection each)")
    if lanes and batch_max < 2:
        raise ConfigError(f"{where}: field 'batch_max' must be >= 2 when batch_lanes are given")
    return ProviderSpec(
        name=name, channel=channel, adapter=adapter, base_url_env=base_url_env, auth=auth, keys_env=keys_env,
        token_path=_path(f"{where}: field 'token_path'", doc["token_path"]) if doc.get("token_path") else None,
        paths=frozenset(_path(f"{where}: field 'paths'", p) for p in strings("paths")),
        batch_lanes=lanes, batch_max=batch_max, idempotency_window_s=window(),
        shared_limit=flag("shared_limit"), concurrency=concurrency,
        fallback_errors=frozenset(strings("fallback_errors")))


def parse_registry(text: str, source: str = "providers.toml") -> Registry:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    providers: dict[str, ProviderSpec] = {}
    for i, entry in enumerate(doc.get("provider", [])):
        spec = _provider(f"{source}: provider #{i + 1}", entry)
        if spec.name in providers:
            raise ConfigError(f"{source}: provider {spec.name!r} is defined twice")
        providers[spec.name] = spec
    channels: dict[str, tuple[str, ...]] = {}
    for channel, names in (doc.get("channels") or {}).items():
        where = f"{source}: [channels] {channel}"
        if channel not in CHANNELS:
            raise ConfigError(f"{where}: not a channel ({', '.join(CHANNELS)})")
        if not isinstance(names, list) or not names or len(set(names)) != len(names):
            raise ConfigError(f"{where}: must list one or more distinct provider names")
        for n in names:
            if n not in providers:
                raise ConfigError(f"{where}: no provider named {n!r}")
            if providers[n].channel != channel:
                raise ConfigError(f"{where}: provider {n!r} serves channel {providers[n].channel!r}")
        channels[channel] = tuple(names)
    return Registry(providers, channels)


@lru_cache(maxsize=8)
def load_registry(path: str | None = None) -> Registry:
    """The packaged providers.toml, or the file at `path`."""
    file = Path(path) if path else DEFAULT_FILE
    try:
        text = file.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the provider file {file}: {exc.strerror}") from None
    return parse_registry(text, str(file))


def adapter_class(spec: ProviderSpec) -> type:
    module, _, cls = spec.adapter.partition(":")
    try:
        return getattr(import_module(module), cls)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"provider {spec.name!r}: field 'adapter': cannot load {spec.adapter} ({exc})") from None


HEADER_SAFE_RE = re.compile(r"[\x21-\x7e]+")  # what a bearer credential may hold: visible ASCII


class ProviderCredentials:
    """API keys per tenant (`*` is the default). One key per tenant keeps their requests apart."""

    def __init__(self, keys: dict[str, str]):
        for tenant, key in keys.items():
            if not HEADER_SAFE_RE.fullmatch(key):  # the key itself never printed
                raise ConfigError(f"the provider API key of tenant {tenant!r} holds a character an HTTP header cannot "
                                  "carry (a space, a line break, a non-ASCII letter): every request under it would "
                                  "fail before it is sent")
        self.keys = dict(keys)
        self._accounts: dict[str, str] = {}  # tenant: `account(tenant)` (asked for every claim)

    def has_own_key(self, tenant: str) -> bool:
        """The tenant's requests go out under a key (an account at the provider) of its own: that account's
        limits are its own, not everyone's."""
        own = self.keys.get(tenant)
        return tenant != "*" and own is not None and own != self.keys.get("*")

    def account(self, tenant: str) -> str:
        """Which key the tenant's requests go under, as a digest ("" for none): a request left with an unknown
        outcome is sent again only under the same key (idempotency keys are kept per account, or per key)."""
        if (known := self._accounts.get(tenant)) is not None:
            return known
        key = self.keys.get(tenant) or self.keys.get("*")
        digest = self._accounts[tenant] = hashlib.sha256(key.encode()).hexdigest()[:16] if key else ""
        return digest

    def for_tenant(self, tenant: str) -> str:
        key = self.keys.get(tenant) or self.keys.get("*")
        if not key:
            raise ConfigError(f"no provider API key for tenant {tenant!r} and no default '*'")
        return key
