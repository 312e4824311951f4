"""The HTTP side of every provider adapter: an allowlisting transport and one `post`.

A path outside a provider's allowlist (audiences, contacts, segments, broadcasts, topics,
anything else) raises ForbiddenProviderPath and is never sent. httpx errors become a
ProviderResult whose outcome the retry policy understands; every non-2xx is logged with its
status and a redacted body.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import httpx
import orjson

from ..errors import ForbiddenProviderPath
from .outcome import Outbound, ProviderResult, classify, error_name, message_ids, redact

log = logging.getLogger("streams.providers")


class Provider(Protocol):
    name: str

    def build(self, messages: list[Outbound], batch: bool) -> tuple[str, bytes]:
        """The request path and body. Deterministic: the same messages give the same bytes."""
        ...

    def submit(self, path: str, body: bytes, api_key: str, idempotency_key: str) -> Future[ProviderResult]:
        """Start the request; the future holds its result (never an exception for a provider's answer)."""
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


class HttpProvider:
    """Base of the JSON-over-HTTP adapters: subclasses set `name`, `allowed` and `build`."""

    name = "http"
    allowed: set[tuple[str, str]] = set()

    def __init__(self, base_url: str, timeout_s: float = 10.0, max_connections: int = 32, concurrency: int = 8):
        # Requests wait on the network in a small pool of threads; the worker's poll thread never does.
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix=f"{self.name}-http")
        self.client = httpx.Client(
            base_url=base_url, transport=AllowlistTransport(self.allowed),
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 3.0)),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    def submit(self, path: str, body: bytes, api_key: str, idempotency_key: str) -> Future[ProviderResult]:
        return self.pool.submit(self.post, path, body, api_key, idempotency_key)

    ready = True

    def poll(self) -> None:
        """Nothing to follow."""

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
            try:
                ids = message_ids(resp.content)
            except (orjson.JSONDecodeError, AttributeError, TypeError):
                # Accepted, probably, but we cannot tell which messages: ask again under the same key.
                log.warning("provider %s answered %s on %s with an unreadable body", self.name, resp.status_code, path)
                return ProviderResult("unknown", resp.status_code, error_name="unreadable_body", latency_s=latency)
            return ProviderResult("delivered", resp.status_code, ids, latency_s=latency)
        # The worker logs one line per failed attempt, with this status and redacted excerpt.
        name = error_name(resp.content)
        excerpt = redact(resp.text)
        return ProviderResult(classify(resp.status_code, name), resp.status_code,
                              retry_after=resp.headers.get("retry-after"), error_name=name, error_body=excerpt,
                              latency_s=latency)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.client.close()
