"""The HTTP side of every provider adapter: an allowlisting transport and one `post`.

A path outside a provider's allowlist (audiences, contacts, segments, broadcasts, topics,
anything else) raises ForbiddenProviderPath and is never sent. httpx errors become a
ProviderResult whose outcome the retry policy understands, named by their class (connection
refused, timeout, TLS ...); the worker logs every failed attempt with its status or class and a
redacted body.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Protocol

import httpx

from ..errors import ForbiddenProviderPath, ProviderAuthError
from . import connections
from .connections import CONNECT_S, KEEPALIVE_S
from .outcome import (
    Outbound,
    ProviderResult,
    classify,
    error_name,
    message_ids,
    provider_excerpt,
    safe_error_name,
    token_outcome,
)
from .registry import ProviderSpec
from .tokens import TokenRefused, TokenSource

log = logging.getLogger("streams.providers")


class Provider(Protocol):
    name: str

    def build(self, messages: list[Outbound], batch: bool) -> tuple[str, bytes]:
        """The request path and body. Deterministic: the same messages give the same bytes, a batch's in send-id
        order (its answer's ids are paired with the send ids in that order)."""
        ...

    def submit(self, path: str, body: bytes, api_key: str, idempotency_key: str,
               tenant: str) -> Future[ProviderResult]:
        """Start the request of `tenant`'s sends; the future holds its result (never an exception for a
        provider's answer)."""
        ...

    @property
    def ready(self) -> bool:
        """Whether requests may start (an adapter may need to catch up with some state first)."""
        ...

    def poll(self) -> None:
        """Called on the worker's poll thread every step (adapters that follow a topic do it here)."""
        ...

    def close(self) -> None: ...


class AllowlistTransport(httpx.BaseTransport):
    """Refuses, before any byte leaves the process, a request outside (method, path) allowlist."""

    def __init__(self, allowed: set[tuple[str, str]], inner: httpx.BaseTransport | None = None,
                 limits: httpx.Limits | None = None):
        self.allowed = allowed
        self.inner = inner or httpx.HTTPTransport(retries=0, limits=limits or httpx.Limits())

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if (request.method, request.url.path) not in self.allowed:
            raise ForbiddenProviderPath(
                f"refused {request.method} {request.url.path}: not in the provider allowlist "
                f"{sorted(self.allowed)}")
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def error_class(exc: httpx.TransportError) -> str:
    """What kind of transport failure, for the evidence line: connection refused, timeout, TLS ..."""
    text = str(exc).lower()
    if isinstance(exc, httpx.ConnectTimeout):
        return "connect_timeout"
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, httpx.ConnectError):
        if "ssl" in text or "certificate" in text or "tls" in text:
            return "tls"
        if "refused" in text:
            return "connection_refused"
        if "name or service" in text or "nodename" in text or "name resolution" in text:
            return "dns"
        return "connect_error"
    if isinstance(exc, httpx.RemoteProtocolError):
        return "protocol_error"
    if isinstance(exc, httpx.ReadError):
        return "connection_reset"
    return type(exc).__name__


class HttpProvider:
    """Base of the JSON-over-HTTP adapters: a protocol module subclasses it and writes `build` (and,
    when its answers differ from Resend's shape, `parse_ids` and `parse_error`). Everything else is
    the same for every provider: the allowlist, authentication (a static key per tenant, or a
    short-lived token refreshed once on a 401), error classification and the evidence it feeds."""

    def __init__(self, spec: ProviderSpec, base_url: str, credentials: dict[str, str] | None = None,
                 timeout_s: float = 10.0, concurrency: int = 8):
        self.spec, self.name = spec, spec.name
        # Requests wait on the network in a small pool of threads; the worker's poll thread never does.
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix=f"{self.name}-http")
        self.timeout_s = timeout_s
        timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, CONNECT_S))
        # Limits go to the transport: httpx.Client ignores its own when given one.
        pooled = httpx.Limits(max_connections=max(concurrency, 4), max_keepalive_connections=max(concurrency, 4),
                              keepalive_expiry=KEEPALIVE_S)
        # Answers uncompressed: what is read of one is bounded (`connections.MAX_ANSWER_BYTES`), and a compressed
        # body within it could still decode to gigabytes.
        plain = {"Accept-Encoding": "identity"}
        self.client = httpx.Client(base_url=base_url, timeout=timeout, headers=plain,
                                   transport=AllowlistTransport(set(spec.allowed), limits=pooled))
        # For the second try of a request whose pooled connection the provider had closed: never a pooled one.
        self.fresh = httpx.Client(base_url=base_url, timeout=timeout, headers=plain, transport=AllowlistTransport(
            set(spec.allowed), limits=httpx.Limits(max_connections=max(concurrency, 4), max_keepalive_connections=0)))
        self.tokens: TokenSource | None = None
        if spec.auth == "token":
            assert spec.token_path is not None  # the registry requires it for token auth
            creds = credentials or {}
            self.tokens = TokenSource(spec.name, self.client, spec.token_path[1], creds.get("client_id", ""),
                                      creds.get("client_secret", ""), fresh=self.fresh)

    def submit(self, path: str, body: bytes, api_key: str, idempotency_key: str,
               tenant: str) -> Future[ProviderResult]:
        return self.pool.submit(self.post, path, body, api_key, idempotency_key)  # the account is the key's

    ready = True

    def poll(self) -> None:
        """Nothing to follow."""

    def build(self, messages: list[Outbound], batch: bool) -> tuple[str, bytes]:
        raise NotImplementedError

    def parse_ids(self, body: bytes) -> tuple[str, ...]:
        """Message ids from a 2xx body (Resend's shapes by default)."""
        return message_ids(body)

    def parse_error(self, body: bytes) -> str:
        """The error's name from a non-2xx body (Resend's `name` by default)."""
        return error_name(body)

    def post(self, path: str, body: bytes, api_key: str, idempotency_key: str) -> ProviderResult:
        """One request; with token auth, a 401 refreshes the token and sends the same request again,
        once, under the same idempotency key (a second 401 is an `auth` outcome)."""
        if ("POST", path) not in self.spec.paths:  # before a token is fetched (the transport checks again)
            raise ForbiddenProviderPath(f"refused POST {path}: not in the provider allowlist {sorted(self.spec.paths)}")
        started = time.monotonic()
        if self.tokens is None:
            return self._post(path, body, api_key, idempotency_key, started)
        first_copy_unknown = False  # a pass before sent its request twice, and the provider may hold a copy
        for attempt in (1, 2):
            try:
                token = self.tokens.get()
            except TokenRefused as exc:
                outcome = token_outcome(exc.status, exc.error)
                name = {"auth": "token_refused", "throttled": "token_throttled"}.get(outcome, "token_unavailable")
                result = ProviderResult(outcome, exc.status, retry_after=exc.retry_after, error_name=name,
                                        error_body=provider_excerpt(str(exc)), latency_s=time.monotonic() - started,
                                        never_sent=attempt == 1)  # else the first pass's request went out
                break
            except ProviderAuthError as exc:  # unreachable, or an answer without a usable token
                result = ProviderResult("unavailable", error_name="token_unavailable",
                                        error_body=provider_excerpt(str(exc)), latency_s=time.monotonic() - started,
                                        never_sent=attempt == 1)
                break
            result = self._post(path, body, token, idempotency_key, started)
            if attempt == 2:  # the first pass's request reached the provider (a 401), whatever became of this one
                result = replace(result, never_sent=False)
            first_copy_unknown = first_copy_unknown or result.first_copy_unknown
            if result.outcome != "auth":
                break
            self.tokens.invalidate(token)
            if attempt == 1:
                log.info("provider %s refused the token (%s): token refreshed, the same request goes once more",
                         self.name, result.status)
        return _with_first_copy_unknown(result) if first_copy_unknown else result

    def _send(self, path: str, body: bytes, headers: dict[str, str], started: float,
              sent_again: list[bool]) -> httpx.Response:
        """POST on a pooled connection. One that the provider closed while it sat idle fails before any answer;
        then, and only at a provider that honours idempotency keys, the request is sent once more on a new
        connection, within what is left of the timeout. Its key is the same, so a provider that did read the
        first copy answers the second from its store. Elsewhere (the provider may have read it before it
        closed) it is an unknown outcome, as is a new connection that fails. `sent_again` is appended to
        when the second copy goes out: whatever it is answered, unless it is a delivery, the provider may
        hold the first copy."""

        def again() -> bool:
            if not self.spec.idempotent:
                return False
            log.info("provider %s closed a pooled connection before answering request %s: sent again on a new one",
                     self.name, headers["Idempotency-Key"])
            sent_again.append(True)
            return True

        return connections.post(self.client, self.fresh, path, body, headers,
                                lambda: self.timeout_s - (time.monotonic() - started), again)

    def _post(self, path: str, body: bytes, bearer: str, idempotency_key: str, started: float) -> ProviderResult:
        sent_again: list[bool] = []
        result = self._answer(path, body, bearer, idempotency_key, started, sent_again)
        return _with_first_copy_unknown(result) if sent_again else result

    def _answer(self, path: str, body: bytes, bearer: str, idempotency_key: str, started: float,
                sent_again: list[bool]) -> ProviderResult:
        try:
            resp = self._send(path, body, {"Authorization": f"Bearer {bearer}", "Content-Type": "application/json",
                                           "Idempotency-Key": idempotency_key}, started, sent_again)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.LocalProtocolError) as exc:
            # Never reached the provider (or refused before a byte left: a header it could not carry): safe to retry.
            return ProviderResult("unavailable", error_name=error_class(exc), latency_s=time.monotonic() - started,
                                  never_sent=True)
        except httpx.TransportError as exc:
            # Sent, and the answer was lost: the provider may have accepted it.
            return ProviderResult("unknown", error_name=error_class(exc), latency_s=time.monotonic() - started)
        latency = time.monotonic() - started
        if resp.is_success and resp.extensions.get("cut"):
            # Accepted, probably; what it named is past what is read (`connections.MAX_ANSWER_BYTES`).
            log.warning("provider %s answered %s on %s with a body too large to read", self.name, resp.status_code,
                        path)
            return ProviderResult("unknown", resp.status_code, error_name="answer_too_large", latency_s=latency)
        if resp.is_success:
            try:
                ids = self.parse_ids(resp.content)
            except (ValueError, AttributeError, TypeError, KeyError):  # not JSON (cut?), or no id we can keep
                # Accepted, probably, but we cannot tell which messages: ask again under the same key.
                log.warning("provider %s answered %s on %s with an unreadable body", self.name, resp.status_code, path)
                return ProviderResult("unknown", resp.status_code, error_name="unreadable_body", latency_s=latency)
            if not any(ids):
                # A 2xx that names no message did not take it (the channel's next provider may).
                return ProviderResult("rejected", resp.status_code, error_name="no_message_id",
                                      error_body=provider_excerpt(_text(resp), secrets=(bearer,)), latency_s=latency)
            if not all(ids):
                # Some of the batch's messages named, some not: taken in part, and which is not said. Not a
                # rejection (a replay or the next provider would send the named ones twice): asked again under
                # its key, it ends dead-lettered unknown_outcome, for an operator to check.
                return ProviderResult("unknown", resp.status_code, error_name="message_id_missing",
                                      error_body=provider_excerpt(_text(resp), secrets=(bearer,)), latency_s=latency)
            return ProviderResult("delivered", resp.status_code, ids, latency_s=latency)
        # The worker logs one line per failed attempt, with this status and redacted excerpt.
        name = safe_error_name(self.parse_error(resp.content))
        return ProviderResult(classify(resp.status_code, name), resp.status_code,
                              retry_after=resp.headers.get("retry-after"), error_name=name,
                              error_body=provider_excerpt(_text(resp), secrets=(bearer,)), latency_s=latency)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.client.close()
        self.fresh.close()


def _text(resp: httpx.Response) -> str:
    """An answer's body as text for its excerpt: in the charset it claims (so a key it echoes is found and masked),
    else as UTF-8 (`resp.text` raises on a charset the body does not match, or one that is no text encoding,
    which lost the answer's status: a 429's cool-down, a 4xx's rejection)."""
    try:
        return resp.text
    except Exception:  # noqa: BLE001 - a charset may name any codec (unknown, base64, rot13): each fails its own way
        return resp.content.decode("utf-8", "replace")


def _with_first_copy_unknown(result: ProviderResult) -> ProviderResult:
    """A result of a request sent twice: unless delivered, the provider may hold the first copy."""
    return result if result.outcome == "delivered" else replace(result, first_copy_unknown=True, never_sent=False)
