"""The webhook channel's adapter: one signed HTTP POST per delivery to its endpoint, hundreds in
flight at once on an asyncio event loop of its own (slow receivers are the norm, so a thread per
request would not do), driven by the lane worker like any provider adapter. The HTTP client is
aiohttp's: with a thousand requests in flight, httpx's async pool spends most of its time assigning
requests to connections (measured: about 20 deliveries/s against about 1,000 with aiohttp).

Per attempt: the endpoint as the operator log says now (a deleted or disabled endpoint is skipped,
never called), its URL checked again against the SSRF rules (DNS may have changed since
registration), Standard Webhooks headers (the delivery id as `webhook-id`, this attempt's time,
one signature per valid secret), a 10 s total timeout (a second try on a new connection included),
and no redirects followed. Only a 2xx is a
success; 410 means the endpoint is gone; 429, or 503 with Retry-After, asks us to wait; anything
else (3xx, 4xx, 5xx, a connection error, a timeout) is a failure to retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import aiohttp
import orjson

from .. import metrics
from ..providers.connections import KEEPALIVE_S
from ..providers.outcome import Outbound, Outcome, ProviderResult, UnusablePayload, redact
from ..stamped import StampedTable
from .egress import EgressWatch
from .endpoints import EndpointDirectory
from .lookups import LookupFailed, addresses_of, name_resolver
from .model import Endpoint
from .sealing import Sealer, UnsealError, open_secret
from .signing import headers as signed_headers
from .ssrf import UnsafeUrl, UrlPolicy, wire_host

EXCERPT_BYTES = 1024
DRAIN_S = 1.0  # how long an answer's body is waited for (a 2xx's only so its connection can be reused)
DNS_TTL_S = 30.0
APPROVAL_KEPT_S = 300.0  # a host's approved addresses, kept well past any attempt that connects right after
VIEW_SYNC_S = 5.0  # how long an unknown endpoint waits for the endpoint view to read the operator log to its end
DNS_TIMEOUT_S = 5.0
UNSEAL_LOG_EVERY_S = 60.0
EGRESS_LOG_EVERY_S = 60.0
CONNECT_TRIED_S = 1.0  # a connection not open after this long is a receiver not reached


log = logging.getLogger("streams.webhooks")


class PinnedResolver(aiohttp.abc.AbstractResolver):
    """The HTTP client's resolver: it answers only with the addresses the URL policy approved for a
    host, so the connection goes where the check looked. (Resolving again at connect time would let
    a DNS answer that changed in between, a rebinding, reach a private address.) A host not checked
    yet does not resolve."""

    def __init__(self) -> None:
        self.approved: StampedTable[str, list[str]] = StampedTable(APPROVAL_KEPT_S)  # host -> (when, addresses)

    def approve(self, host: str, addresses: list[str]) -> None:
        """`host` as the client looks it up (`wire_host`), right before a request connects to it. Hosts approved
        long ago are dropped once the table has doubled: a tenant could otherwise grow every worker's memory
        without a bound by sending to new host names (wildcard DNS)."""
        self.approved.put(host, addresses, time.monotonic())

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[aiohttp.abc.ResolveResult]:
        addresses = self.approved.get(host, (0.0, []))[1]
        if not addresses:
            raise OSError(f"{host}: no address approved by the URL policy")
        return [{"hostname": host, "host": a, "port": port,
                 "family": socket.AF_INET6 if ipaddress.ip_address(a).version == 6 else socket.AF_INET,
                 "proto": 0, "flags": socket.AI_NUMERICHOST} for a in addresses]

    async def close(self) -> None:
        return None


def delivery_body(payload: dict) -> bytes:
    """What a receiver gets: the same bytes on every attempt (the payload's own key order)."""
    occurred = payload["occurredAt"] if "occurredAt" in payload else payload["occurred_at"]  # ingest takes both
    return orjson.dumps({"id": payload.get("event_id"), "type": payload["event_type"],
                         "timestamp": occurred, "data": payload["data"]})


def classify(status: int, headers: dict[str, str], head: bytes, latency_s: float) -> ProviderResult:
    """The outcome of a receiver's answer (`head`: the first bytes of its body)."""
    excerpt = redact(head[:EXCERPT_BYTES].decode(errors="replace"), EXCERPT_BYTES)
    if 200 <= status < 300:
        return ProviderResult("delivered", status, latency_s=latency_s)
    retry_after = headers.get("retry-after")
    outcome: Outcome
    if status == 410:
        outcome = "gone"
    elif status == 429 or (status == 503 and retry_after):
        outcome = "throttled"
    else:
        outcome = "unavailable"  # 3xx (not followed), 4xx, 5xx: a failure, retried
    return ProviderResult(outcome, status, retry_after=retry_after, error_name=f"http_{status}",
                          error_body=excerpt, latency_s=latency_s)


def reuse_tracer() -> aiohttp.TraceConfig:
    """Marks a request's `trace_request_ctx` (a dict) with "reused" when it went out on a pooled connection, and with
    "connecting" and "connected" as it opens a new one (a pool slot had come free: waiting for one is neither), each
    with its time."""
    trace = aiohttp.TraceConfig()

    def mark(flag: str):
        async def marked(session: aiohttp.ClientSession, ctx: Any, params: Any) -> None:
            ctx.trace_request_ctx[flag] = time.monotonic()
        return marked

    trace.on_connection_reuseconn.append(mark("reused"))
    trace.on_connection_create_start.append(mark("connecting"))
    trace.on_connection_create_end.append(mark("connected"))
    return trace


class ConnectTimeout(TimeoutError):
    """The attempt's time ran out opening a connection to the receiver (none was pooled), after CONNECT_TRIED_S at
    least: it was never reached (or its TLS handshake stalled, which aiohttp does not tell apart)."""


async def post_delivery(session: aiohttp.ClientSession, fresh: aiohttp.ClientSession, url: str, body: bytes,
                        headers: dict[str, str], started: float, timeout_s: float) -> ProviderResult:
    """POST one delivery within `timeout_s` of `started`. A pooled connection that the receiver closed
    while it sat idle (many servers close idle connections after 5 s) fails the next request before any
    answer; only then (`session` must carry `reuse_tracer()`) is the request sent once more, within the
    same time, through `fresh`: a session that never reuses a connection (the pool may hold more
    connections the receiver closed, as after a burst). Its webhook-id is the same, so a receiver that
    did get the first copy deduplicates it. A new connection that fails is a failure of the attempt."""
    first: dict[str, float] = {}
    left = timeout_s - (time.monotonic() - started)  # the name lookup came out of the same time
    if left <= 0:
        raise TimeoutError
    try:
        resp = await session.post(url, data=body, headers=headers, allow_redirects=False, trace_request_ctx=first,
                                  timeout=aiohttp.ClientTimeout(total=left))
    except TimeoutError:
        connecting = first.get("connecting")
        if connecting and not first.get("connected") and time.monotonic() - connecting >= CONNECT_TRIED_S:
            raise ConnectTimeout from None  # (a pool slot that came free as the time ran out is not a failed connect)
        raise
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
        if isinstance(exc, aiohttp.ClientConnectorError) or not first.get("reused"):
            raise  # no connection at all, or a new one: another is no different
        left = timeout_s - (time.monotonic() - started)
        if left <= 0:
            raise TimeoutError from exc
        resp = await fresh.post(url, data=body, headers=headers, allow_redirects=False,
                                timeout=aiohttp.ClientTimeout(total=left))
    async with resp:
        answer = {k.lower(): v for k, v in resp.headers.items()}
        latency = time.monotonic() - started
        if 200 <= resp.status < 300:
            # Delivered whatever the body does next. A short body is read, so the connection can be reused;
            # one that stalls is given up on (its connection closed), not taken for a failed attempt.
            with contextlib.suppress(TimeoutError, aiohttp.ClientError):
                await asyncio.wait_for(resp.content.read(EXCERPT_BYTES), DRAIN_S)
            return classify(resp.status, answer, b"", latency)
        # The status says what happened (a 410, a 429's Retry-After); a body that stalls does not make it a timeout.
        head = b""
        with contextlib.suppress(TimeoutError, aiohttp.ClientError):
            head = await asyncio.wait_for(resp.content.read(EXCERPT_BYTES), DRAIN_S)
        return classify(resp.status, answer, head, time.monotonic() - started)


class WebhookDelivery:
    name = "webhook"

    def __init__(self, directory: EndpointDirectory, policy: UrlPolicy, timeout_s: float = 10.0,
                 concurrency: int = 256, sealer: Sealer | None = None, nameservers: list[str] | None = None):
        self.directory, self.policy, self.timeout_s = directory, policy, timeout_s
        self.sealer = sealer  # opens the signing secrets stored sealed
        self._unseal_logged: dict[str, float] = {}  # endpoint -> when a secret that does not open was last logged
        self._dns: StampedTable[str, list[str]] = StampedTable(DNS_TTL_S)  # answers of hosts no longer sent to dropped
        self._looking_up: dict[str, asyncio.Future] = {}
        # Bringing the endpoint view up to the log's end, for deliveries to endpoints it does not know: one at a
        # time, on a thread of its own (it waits on the broker), shared by the deliveries waiting meanwhile.
        self._view_sync: asyncio.Future[bool] | None = None
        self._view_syncer = ThreadPoolExecutor(1, thread_name_prefix="webhook-view-sync")
        self.resolver = PinnedResolver()
        self.egress = EgressWatch()  # used on the deliveries' loop only
        self._egress_logged = -EGRESS_LOG_EVERY_S
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="webhook-deliveries", daemon=True)
        self._thread.start()
        # Name lookups by c-ares on this loop (the system's name servers unless told): a lookup waiting for a
        # name server that never answers holds a timer, not a thread.
        self.names = asyncio.run_coroutine_threadsafe(name_resolver(nameservers), self.loop).result(10)
        self.session = asyncio.run_coroutine_threadsafe(self._session(concurrency, pooled=True), self.loop).result(10)
        self.fresh = asyncio.run_coroutine_threadsafe(self._session(concurrency, pooled=False), self.loop).result(10)

    async def _session(self, concurrency: int, pooled: bool) -> aiohttp.ClientSession:
        """Both sessions connect only where the URL policy approved (the pinned resolver). The pooled one
        drops a connection idle for KEEPALIVE_S, before most receivers would close it themselves."""
        connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=0, resolver=self.resolver,
                                         use_dns_cache=False, force_close=not pooled,
                                         keepalive_timeout=KEEPALIVE_S if pooled else None)
        # No cookies, ever: the sessions serve every tenant, and a cookie one receiver set (for a parent
        # domain, even `com`) would go out with other tenants' deliveries.
        return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                     trace_configs=[reuse_tracer()] if pooled else None,
                                     cookie_jar=aiohttp.DummyCookieJar())

    def build(self, messages: list[Outbound], batch: bool) -> tuple[str, bytes]:
        """The endpoint id (our 'path') and the body. A webhook delivery is never batched. An event naming
        another tenant's endpoint (written to the lane topic past ingest, which fans out to the tenant's
        own) is never delivered."""
        if batch or len(messages) != 1:
            raise ValueError("a webhook delivery carries exactly one event")
        endpoint_id = messages[0].payload["endpoint_id"]
        ep = self.directory.get(endpoint_id)
        if ep is not None and ep.tenant != messages[0].tenant:
            raise UnusablePayload(f"the endpoint {str(endpoint_id)[:80]!r} is not this tenant's")
        return endpoint_id, delivery_body(messages[0].payload)

    async def _view_caught_up(self) -> bool:
        """Whether the endpoint view holds everything the log held when this was asked (at most VIEW_SYNC_S). A
        catch-up already under way is joined, and then one more is made: the one joined may have learnt where the
        log ends before this delivery's endpoint was written there."""
        loop = asyncio.get_running_loop()
        joined = self._view_sync is not None and not self._view_sync.done()
        for _ in range(2 if joined else 1):
            if self._view_sync is None or self._view_sync.done():
                self._view_sync = loop.run_in_executor(self._view_syncer, self.directory.sync, VIEW_SYNC_S)
            caught_up = await asyncio.shield(self._view_sync)
        return caught_up

    def submit(self, path: str, body: bytes, api_key: str, idempotency_key: str,
               tenant: str) -> Future[ProviderResult]:
        msg_id = idempotency_key.removeprefix("send-")  # the delivery id: stable across retries
        return asyncio.run_coroutine_threadsafe(self._deliver(path, body, msg_id, tenant), self.loop)

    async def _deliver(self, endpoint_id: str, body: bytes, msg_id: str, tenant: str) -> ProviderResult:
        ep = self.directory.get(endpoint_id)
        if ep is None:
            # Deleted, or created a moment ago and not read by this view yet (the API that fanned the event
            # out had read it; the lane's record can come before the operator log's): only a view holding
            # everything the log holds now may say deleted, which skips the delivery for good.
            started = time.monotonic()
            caught_up = await self._view_caught_up()
            ep = self.directory.get(endpoint_id)
            if ep is None and not caught_up:  # retried on its schedule; not the endpoint's failure
                return ProviderResult("unavailable", error_name="endpoint_view_behind",
                                      latency_s=time.monotonic() - started, never_sent=True)
        if ep is None:
            return ProviderResult("skipped", error_name="endpoint_deleted")
        if ep.tenant != tenant:
            # An event naming another tenant's endpoint, written to the lane past ingest, that `build` could not
            # refuse (the view had not read the endpoint yet; or a stored request re-sent): never delivered, nor
            # signed with that tenant's secret. Dead-lettered; not the endpoint's failure (health ignores it).
            return ProviderResult("rejected", error_name="endpoint_of_another_tenant")
        if not ep.enabled or ep.state == "disabled":
            return ProviderResult("skipped", error_name="endpoint_disabled")
        if ep.state == "degraded":  # never retried or probed until someone reactivates it
            return ProviderResult("skipped", error_name="endpoint_degraded")
        started = time.monotonic()
        host = wire_host(ep.url)
        try:
            resolve = await self._resolve(host)
        except TimeoutError:
            return self._unreached(ep, ProviderResult("unavailable", error_name="dns_timeout",
                                                      latency_s=time.monotonic() - started, never_sent=True))
        except LookupFailed as exc:
            return self._unreached(ep, ProviderResult("unavailable", error_name="dns_lookup_failed",
                                                      error_body=str(exc)[:EXCERPT_BYTES],
                                                      latency_s=time.monotonic() - started, never_sent=True))
        try:
            self.policy.check(ep.url, resolve)
        except UnsafeUrl as exc:
            return ProviderResult("unavailable", error_name="unsafe_url", error_body=str(exc)[:EXCERPT_BYTES],
                                  never_sent=True)
        try:
            addresses = resolve(host)  # the connection may use only these
        except OSError as exc:  # an allowlisted host that does not resolve
            return ProviderResult("unavailable", error_name="dns_failure", error_body=str(exc)[:EXCERPT_BYTES],
                                  never_sent=True)
        self.resolver.approve(host, addresses)
        now = time.time()
        secrets = self._open_secrets(ep, int(now * 1000))
        if not secrets:  # the current secret does not open (an operator's key): retried, never sent unsigned
            return ProviderResult("unavailable", error_name="secret_unreadable", never_sent=True,
                                  error_body="the endpoint's signing secret cannot be opened (an operator's key)")
        h = {**signed_headers(secrets, msg_id, int(now), body),
             "content-type": "application/json", "user-agent": "dual-rail-dispatch-webhooks/1"}
        try:
            result = await post_delivery(self.session, self.fresh, ep.url, body, h, started, self.timeout_s)
        except ConnectTimeout:  # never connected: the receiver was not reached (a slow receiver's timeout was)
            return self._unreached(ep, ProviderResult("unavailable", error_name="ConnectTimeout",
                                                      latency_s=time.monotonic() - started))
        except TimeoutError:
            return ProviderResult("unavailable", error_name="Timeout", latency_s=time.monotonic() - started)
        except aiohttp.ClientError as exc:  # (a refused connection may be the second copy's: the first went out)
            failed = ProviderResult("unavailable", error_name=type(exc).__name__, latency_s=time.monotonic() - started)
            if isinstance(exc, aiohttp.ClientSSLError):
                self.egress.answered()  # a TLS handshake that failed: the receiver was reached
            elif isinstance(exc, aiohttp.ClientConnectorError):
                return self._unreached(ep, failed)  # no connection
            return failed
        self.egress.answered()
        return replace(result, target=ep.url)  # a 410 disables the endpoint only if it still has this URL

    def _unreached(self, ep: Endpoint, failed: ProviderResult) -> ProviderResult:
        """A delivery that could not reach its receiver (no name, no connection): `failed`, or, while receivers of
        several tenants could not be reached and none answered, the same attempt as `egress_unavailable`: our way
        out is down, which is not the endpoint's failure (see egress.py)."""
        if not self.egress.unreachable(ep.tenant, time.monotonic()):
            return failed
        metrics.WEBHOOK_EGRESS_UNAVAILABLE.inc()
        if time.monotonic() - self._egress_logged >= EGRESS_LOG_EVERY_S:  # one line a minute
            self._egress_logged = time.monotonic()
            log.error("webhook egress looks down: receivers of %d tenants could not be reached in the last %.0f s "
                      "and none answered (the last: %s); such attempts are not counted against their endpoints",
                      self.egress.tenants, self.egress.window_s, failed.error_name)
        return replace(failed, error_name="egress_unavailable",
                       error_body="; ".join(filter(None, (f"{failed.error_name}: receivers of {self.egress.tenants} "
                                                          "tenants could not be reached and none answered since",
                                                          failed.error_body)))[:EXCERPT_BYTES])

    def _open_secrets(self, ep: Endpoint, now_ms: int) -> list[str]:
        """The secrets to sign with, the current one first; none when the current one does not open. A previous
        secret that does not open is left out (the receiver holds the current one)."""
        opened: list[str] = []
        for n, value in enumerate(ep.signing_secrets(now_ms)):
            try:
                opened.append(open_secret(value, ep.id, self.sealer))
            except UnsealError as exc:
                if n == 0:
                    metrics.SECRETS_UNREADABLE.inc()
                last = self._unseal_logged.get(ep.id, -UNSEAL_LOG_EVERY_S)
                if time.monotonic() - last >= UNSEAL_LOG_EVERY_S:  # one line a minute per endpoint
                    self._unseal_logged[ep.id] = time.monotonic()
                    log.error("webhook %s: %s", "delivery not attempted" if n == 0 else "signed without a previous "
                              "secret", exc)
                if n == 0:
                    return []
        return opened

    async def _resolve(self, host: str):
        """A resolver for the URL policy, with addresses cached DNS_TTL_S. One lookup per host at a time however
        many deliveries wait for it, waited for at most DNS_TIMEOUT_S (TimeoutError): a tenant's name server that
        never answers costs its own deliveries 5 s each, and nobody else anything (the lookups hold no thread:
        before, they ran on 32 threads, which the silent name servers of 8 tenants could fill for everyone)."""
        cached = self._dns.get(host)
        if cached is not None and time.monotonic() - cached[0] <= DNS_TTL_S:
            addresses = cached[1]
        else:
            addresses = await asyncio.wait_for(self._lookup(host), min(DNS_TIMEOUT_S, self.timeout_s))

        def resolve(name: str) -> list[str]:
            if not addresses:
                raise OSError(f"{name} does not resolve")
            return addresses

        return resolve

    async def _lookup(self, host: str) -> list[str]:
        lookup = self._looking_up.get(host)
        if lookup is None:
            lookup = asyncio.ensure_future(addresses_of(self.names, host, min(DNS_TIMEOUT_S, self.timeout_s)))
            self._looking_up[host] = lookup
            lookup.add_done_callback(lambda done: self._looked_up(host, done))
        return await asyncio.shield(lookup)  # a waiter giving up leaves the lookup to the others

    def _looked_up(self, host: str, done: asyncio.Future) -> None:
        self._looking_up.pop(host, None)
        # Only answers are cached: a failed lookup (one name server's bad second) is made again by the next
        # delivery, instead of failing every delivery to the host for DNS_TTL_S.
        if not done.cancelled() and done.exception() is None:
            self._dns.put(host, done.result(), time.monotonic())

    @property
    def ready(self) -> bool:
        """Deliveries wait until the endpoint view has caught up with the operator log."""
        return self.directory.caught_up

    def poll(self) -> None:
        """Follow endpoint changes (called on the worker's poll thread)."""
        self.directory.poll()

    def close(self) -> None:
        self._view_syncer.shutdown(wait=True, cancel_futures=True)
        self.directory.close()
        asyncio.run_coroutine_threadsafe(self.session.close(), self.loop).result(10)
        asyncio.run_coroutine_threadsafe(self.fresh.close(), self.loop).result(10)
        asyncio.run_coroutine_threadsafe(self.names.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()
