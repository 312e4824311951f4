"""Provider adapters behind one interface: a Resend-compatible email adapter and an SMS adapter.

Every request goes through an allowlisting transport: a path outside the provider's allowlist
(audiences, contacts, segments, broadcasts, topics, anything else) raises ForbiddenProviderPath and
is never sent. Library errors become a ProviderResult whose `outcome` the retry policy understands;
every non-2xx is logged with its status and a redacted body.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import Literal, Protocol

import httpx
import orjson

from .errors import ConfigError, ForbiddenProviderPath

log = logging.getLogger("streams.providers")

Outcome = Literal["delivered", "throttled", "quota", "rejected", "unavailable", "unknown", "auth"]
RESEND_BATCH_MAX = 100
_QUOTA_429 = {"daily_quota_exceeded", "monthly_quota_exceeded"}
_EMAIL_RE = re.compile(r"[^\s\"'<>@,;:]+@[^\s\"'<>@,;:]+")
_PHONE_RE = re.compile(r"\+?\d[\d\s().-]{6,}\d")
_KEY_RE = re.compile(r"\bre_[A-Za-z0-9_]+")


def redact(text: str, limit: int = 500) -> str:
    """Strip what identifies a person or unlocks an account from a provider's error body."""
    text = _KEY_RE.sub("re_***", text)
    text = _EMAIL_RE.sub("***@***", text)
    return _PHONE_RE.sub("+***", text)[:limit]


@dataclass(frozen=True)
class ProviderResult:
    outcome: Outcome
    status: int | None = None
    message_ids: tuple[str, ...] = ()
    retry_after: str | None = None
    error_name: str = ""
    error_body: str = ""          # redacted
    latency_s: float = 0.0


@dataclass(frozen=True)
class Outbound:
    """One message for the provider: the frozen payload plus the routing tags we attach."""

    send_id: str
    tenant: str
    lane: str
    payload: dict

    def tags(self) -> list[dict]:
        own = [t for t in self.payload.get("tags", []) if isinstance(t, dict)]
        return own + [{"name": "send_id", "value": self.send_id}, {"name": "tenant", "value": self.tenant},
                      {"name": "lane", "value": self.lane}]


class Provider(Protocol):
    name: str

    def build(self, messages: list[Outbound], batch: bool) -> tuple[str, bytes]:
        """The request path and body. Deterministic: the same messages give the same bytes."""
        ...

    def post(self, path: str, body: bytes, api_key: str, idempotency_key: str) -> ProviderResult: ...

    def close(self) -> None: ...


class AllowlistTransport(httpx.BaseTransport):
    """Refuses, before any byte leaves the process, a request outside (method, path) allowlist."""

    def __init__(self, allowed: set[tuple[str, str]], inner: httpx.BaseTransport | None = None):
        self.allowed = allowed
        self.inner = inner or httpx.HTTPTransport(retries=0)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if (request.method, request.url.path) not in self.allowed:
            raise ForbiddenProviderPath(
                f"refused {request.method} {request.url.path}: not in the provider allowlist "
                f"{sorted(self.allowed)}")
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def _classify(resp: httpx.Response) -> tuple[Outcome, str]:
    name = ""
    try:
        body = orjson.loads(resp.content)
        if isinstance(body, dict):
            name = str(body.get("name", ""))
    except orjson.JSONDecodeError:
        pass
    status = resp.status_code
    if status == 429:
        return ("quota" if name in _QUOTA_429 else "throttled"), name
    if status == 401:
        return "auth", name
    if status == 409 and name == "concurrent_idempotent_requests":
        return "unavailable", name  # the first request is still running: try again later
    if 400 <= status < 500:
        return "rejected", name
    return "unavailable", name


class _HttpProvider:
    name = "http"
    allowed: set[tuple[str, str]] = set()

    def __init__(self, base_url: str, timeout_s: float = 10.0, max_connections: int = 32):
        self.client = httpx.Client(
            base_url=base_url, transport=AllowlistTransport(self.allowed),
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 3.0)),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    def post(self, path: str, body: bytes, api_key: str, idempotency_key: str) -> ProviderResult:
        started = time.monotonic()
        try:
            resp = self.client.post(path, content=body, headers={
                "Authorization": f"Bearer {api_key}", "Content-Type": "application/json",
                "Idempotency-Key": idempotency_key})
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            # Never reached the provider: safe to retry.
            return ProviderResult("unavailable", error_name=type(exc).__name__,
                                  latency_s=time.monotonic() - started)
        except httpx.TransportError as exc:
            # Sent, and the answer was lost: the provider may have accepted it.
            return ProviderResult("unknown", error_name=type(exc).__name__,
                                  latency_s=time.monotonic() - started)
        latency = time.monotonic() - started
        if resp.is_success:
            return ProviderResult("delivered", resp.status_code, self._ids(resp), latency_s=latency)
        outcome, name = _classify(resp)
        body = redact(resp.text)
        log.warning("provider %s answered %s on %s: %s", self.name, resp.status_code, path, body)
        return ProviderResult(outcome, resp.status_code, retry_after=resp.headers.get("retry-after"),
                              error_name=name, error_body=body, latency_s=latency)

    @staticmethod
    def _ids(resp: httpx.Response) -> tuple[str, ...]:
        body = orjson.loads(resp.content)
        if isinstance(body, dict) and isinstance(body.get("data"), list):
            return tuple(str(d.get("id", "")) for d in body["data"])
        return (str(body.get("id", "")),) if isinstance(body, dict) else ()

    def close(self) -> None:
        self.client.close()


class ResendEmail(_HttpProvider):
    """Resend's `POST /emails` and `POST /emails/batch` (at most 100 emails per request)."""

    name = "resend"
    allowed = {("POST", "/emails"), ("POST", "/emails/batch")}
    _FIELDS = ("from", "to", "subject", "html", "text", "reply_to", "cc", "bcc", "headers")

    def build(self, messages: list[Outbound], batch: bool) -> tuple[str, bytes]:
        bodies = [{**{k: m.payload[k] for k in self._FIELDS if k in m.payload}, "tags": m.tags()}
                  for m in sorted(messages, key=lambda m: m.send_id)]
        if batch:
            if not 1 <= len(bodies) <= RESEND_BATCH_MAX:
                raise ValueError(f"a Resend batch holds 1..{RESEND_BATCH_MAX} emails, got {len(bodies)}")
            return "/emails/batch", orjson.dumps(bodies)
        if len(bodies) != 1:
            raise ValueError("the single-email endpoint takes exactly one email")
        return "/emails", orjson.dumps(bodies[0])


class SmsGateway(_HttpProvider):
    """An SMS gateway's `POST /sms/messages` (one message per request)."""

    name = "sms"
    allowed = {("POST", "/sms/messages")}

    def build(self, messages: list[Outbound], batch: bool) -> tuple[str, bytes]:
        if batch or len(messages) != 1:
            raise ValueError("the SMS gateway takes one message per request")
        m = messages[0]
        return "/sms/messages", orjson.dumps({"to": m.payload["to"], "body": m.payload["body"],
                                              "tags": m.tags()})


@dataclass(frozen=True)
class ProviderCredentials:
    """API keys per tenant (`*` is the default). One key per tenant keeps their requests apart."""

    keys: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, raw: str, where: str) -> "ProviderCredentials":
        try:
            keys = orjson.loads(raw) if raw else {}
        except orjson.JSONDecodeError:
            raise ConfigError(f"{where} must be a JSON object of tenant -> API key") from None
        if not isinstance(keys, dict) or not all(isinstance(v, str) and v for v in keys.values()):
            raise ConfigError(f"{where} must be a JSON object of tenant -> API key")
        return cls(keys)

    def for_tenant(self, tenant: str) -> str:
        key = self.keys.get(tenant) or self.keys.get("*")
        if not key:
            raise ConfigError(f"no provider API key for tenant {tenant!r} and no default '*'")
        return key
