"""A provider request on a pooled connection that the provider closed meanwhile is sent again on a new
connection within the same attempt, under the same idempotency key, instead of ending as an unknown
outcome that costs the send an attempt and a retry delay."""

import socket
import socketserver
import threading
from concurrent.futures import wait
from dataclasses import replace

import httpx
import pytest

from streams.errors import ProviderAuthError
from streams.providers.connections import KEEPALIVE_S
from streams.providers.registry import load_registry
from streams.providers.resend import ResendEmail
from streams.providers.sms_b import SmsGatewayB
from streams.providers.tokens import TokenSource

REGISTRY = load_registry()
RESEND = REGISTRY.providers["resend"]


class Provider(socketserver.ThreadingTCPServer):
    """A provider that answers 200 to the first `answered_per_connection` requests of each connection, then
    closes it when the next request arrives, without answering (as a server that closed an idle connection
    just as the client reused it). With `pair_first_answers`, the first answers of the first two connections
    wait until both hold a request, so a client sending two at once keeps two pooled connections."""

    daemon_threads = True

    def __init__(self, answered_per_connection: int = -1, pair_first_answers: bool = False, later_status: int = 200,
                 script: list[int | str] | None = None):
        self.answered_per_connection = answered_per_connection
        # Instead: what each request, in the order they arrive, gets: a status, "close" (the connection closed
        # unanswered), or "close, then refuse" (the provider also stops taking connections).
        self.script = script
        self.later_status = later_status  # the status of every answer on connections after the first
        self.pair = threading.Barrier(2, timeout=10) if pair_first_answers else None
        self.answered: list[int] = []  # requests answered, per connection
        self.keys: list[str] = []  # the idempotency key of every request that arrived ("token": a token request)
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class Handler(socketserver.StreamRequestHandler):
    server: Provider

    def handle(self) -> None:
        with self.server.lock:
            self.server.answered.append(0)
            me = len(self.server.answered) - 1
        while True:
            head = b""
            while not head.endswith(b"\r\n\r\n"):
                line = self.rfile.readline()
                if not line:
                    return
                head += line
            fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line)
            fields = {k.strip().lower(): v.strip() for k, v in fields.items()}
            self.rfile.read(int(fields.get(b"content-length", b"0")))
            with self.server.lock:
                self.server.keys.append(fields.get(b"idempotency-key", b"token").decode())
                action = self.server.script.pop(0) if self.server.script is not None else None
            if action == "close, then refuse":
                self.server.shutdown()  # no longer accepting (its loop has stopped selecting on the socket) ...
                self.server.socket.close()  # ... so a connection attempt from now on is refused
            if self.server.answered[me] == self.server.answered_per_connection or isinstance(action, str):
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if self.server.pair is not None and me < 2 and self.server.answered[me] == 0:
                self.server.pair.wait()
            self.server.answered[me] += 1
            if head.startswith(b"POST /oauth/token "):
                status, body = b"200 OK", b'{"access_token": "tok-%d", "expires_in": 60}' % len(self.server.keys)
            elif action is not None and action != 200:
                status, body = b"%d Refused" % action, b'{"name": "refused"}'
            elif me == 0 or self.server.later_status == 200:
                n = len(self.server.keys)  # Resend's shape and sms-b's
                status, body = b"200 OK", b'{"id": "m-%d", "message": {"sid": "m-%d"}}' % (n, n)
            else:
                status, body = b"%d Refused" % self.server.later_status, b'{"name": "rate_limit_exceeded"}'
            self.wfile.write(b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (status, len(body), body))


def _two_emails(provider: Provider, spec=RESEND):
    """Two emails posted one after the other through one adapter (the second reuses the first's connection)."""
    adapter = ResendEmail(spec, provider.url)
    try:
        return adapter.post("/emails", b"{}", "re_k", "send-1"), adapter.post("/emails", b"{}", "re_k", "send-2")
    finally:
        adapter.close()
        provider.stop()


def test_a_request_on_a_connection_the_provider_closed_is_sent_again_on_a_new_one():
    """Given a provider that closes a connection when its second request arrives, unanswered,
    When two emails are posted one after the other (the second reuses the pooled connection),
    Then both are delivered: the second was sent again, under the same idempotency key, on a new
    connection, and the provider answered one request on each of the two connections."""
    provider = Provider(answered_per_connection=1)
    first, second = _two_emails(provider)
    assert (first.outcome, first.status) == ("delivered", 200)
    assert (second.outcome, second.status) == ("delivered", 200)
    assert provider.answered == [1, 1]
    assert provider.keys == ["send-1", "send-2", "send-2"]


def test_a_second_copy_that_is_not_delivered_says_the_provider_may_hold_the_first():
    """Given a provider that closes a connection when its second request arrives, unanswered, and answers
    429 on every later connection,
    When two emails are posted one after the other (the second is sent again on a new connection: 429),
    Then the second's result is the 429 marked `first_copy_unknown`: the provider may have read the first
    copy before it closed, so the worker keeps the sends claimed under the key (never re-batched under a
    new one) and the first email's result carries no such mark."""
    provider = Provider(answered_per_connection=1, later_status=429)
    first, second = _two_emails(provider)
    assert first.outcome == "delivered" and not first.first_copy_unknown
    assert (second.outcome, second.status, second.first_copy_unknown) == ("throttled", 429, True)
    assert provider.keys == ["send-1", "send-2", "send-2"]


def test_a_second_copy_whose_connection_is_refused_says_the_provider_may_hold_the_first():
    """Given a provider that closes a connection when its second request arrives, unanswered, and from then on
    refuses connections,
    When two emails are posted one after the other (the second's copy, sent again, meets a refused connection),
    Then the second's result is `unavailable` (that copy never reached the provider) marked `first_copy_unknown`:
    the first copy may have, so the worker keeps its sends claimed under the key instead of freeing them as a
    request that never left."""
    provider = Provider(script=[200, "close, then refuse"])
    first, second = _two_emails(provider)
    assert first.outcome == "delivered" and not first.first_copy_unknown
    assert (second.outcome, second.error_name, second.first_copy_unknown) == ("unavailable", "connection_refused", True)
    assert not second.never_sent  # its first copy went out: the provider may have counted it
    assert provider.keys == ["send-1", "send-2"]


def test_the_mark_of_a_second_copy_outlives_a_token_refresh():
    """Given an SMS provider with short-lived tokens that closes the connection of the first SMS unanswered, answers
    its copy sent again 401 (the token expired), and the same SMS under a new token 429,
    When the SMS is sent,
    Then the result is the 429 marked `first_copy_unknown`: the first copy, sent before the token was refreshed,
    may be held by the provider, though the last pass sent its request once."""
    provider = Provider(script=[200, "close", 401, 200, 429])
    adapter = SmsGatewayB(REGISTRY.providers["sms-b"], provider.url, {"client_id": "id", "client_secret": "s"})
    try:
        result = adapter.post("/v2/messages", b"{}", "unused", "send-1")
    finally:
        adapter.close()
        provider.stop()
    assert (result.outcome, result.status, result.first_copy_unknown) == ("throttled", 429, True)
    assert provider.keys == ["token", "send-1", "send-1", "token", "send-1"]


def test_the_pool_limits_reach_the_connections():
    """httpx.Client ignores its own `limits` when it is given a transport: they are the transport's."""
    adapter = ResendEmail(RESEND, "http://provider.test", concurrency=6)
    try:
        pool = adapter.client._transport.inner._pool
        assert (pool._keepalive_expiry, pool._max_connections, pool._max_keepalive_connections) == (KEEPALIVE_S, 6, 6)
        assert adapter.fresh._transport.inner._pool._max_keepalive_connections == 0
    finally:
        adapter.close()


def test_the_second_try_never_takes_another_closed_connection_from_the_pool():
    """Given a provider that closes a connection when its second request arrives, unanswered,
    and two pooled connections to it (two emails posted at once, then idle),
    When a third email is posted (its first try meets one closed connection, the other is closed too),
    Then it is delivered: its second try went out on a new connection, not on the other pooled one."""
    provider = Provider(answered_per_connection=1, pair_first_answers=True)
    adapter = ResendEmail(RESEND, provider.url)
    try:
        burst = [adapter.submit("/emails", b"{}", "re_k", f"send-{i}", "acme") for i in (1, 2)]
        wait(burst, timeout=20)
        assert [f.result().outcome for f in burst] == ["delivered", "delivered"] and provider.answered == [1, 1]
        third = adapter.post("/emails", b"{}", "re_k", "send-3")
    finally:
        adapter.close()
        provider.stop()
    assert (third.outcome, third.status) == ("delivered", 200)
    assert provider.answered == [1, 1, 1]  # one on each pooled connection, the third on a new one
    assert provider.keys.count("send-3") == 2


def test_a_new_connection_the_provider_closes_unanswered_is_an_unknown_outcome_not_sent_again():
    """Given a provider that closes every connection when its first request arrives, unanswered,
    When an email is posted (on a new connection: nothing pooled yet),
    Then the attempt's outcome is unknown (the provider may have acted on it: only a pooled connection's
    failure is sent again at once) and the provider saw one request on one connection."""
    provider = Provider(answered_per_connection=0)
    adapter = ResendEmail(RESEND, provider.url)
    try:
        result = adapter.post("/emails", b"{}", "re_k", "send-1")
    finally:
        adapter.close()
        provider.stop()
    assert result.outcome == "unknown" and result.error_name == "protocol_error"
    assert provider.answered == [0] and provider.keys == ["send-1"]


def test_a_provider_without_idempotency_keys_is_never_sent_the_request_again():
    """Given a provider that does not honour idempotency keys, and closes a connection when its second
    request arrives, unanswered,
    When two emails are posted one after the other (the second reuses the pooled connection),
    Then the second's outcome is unknown (left to reconciliation by the worker) and it was sent once:
    the provider may have read it before it closed, and nothing would stop it delivering a second copy."""
    provider = Provider(answered_per_connection=1)
    first, second = _two_emails(provider, replace(RESEND, idempotency_window_s=0))
    assert first.outcome == "delivered" and second.outcome == "unknown"
    assert provider.answered == [1] and provider.keys == ["send-1", "send-2"]


def test_a_token_request_on_a_connection_the_provider_closed_is_asked_again_on_a_new_one():
    """Given a token endpoint that closes a connection when its second request arrives, unanswered,
    When a token is fetched, dropped (as after a 401) and fetched again on the pooled connection,
    Then the second fetch gets a token too, asked again on a new connection (before, it failed as
    `token_unavailable`, costing the send an attempt), and a token source without a fresh client does not
    ask again."""
    provider = Provider(answered_per_connection=1)
    pooled = httpx.Client(base_url=provider.url, timeout=5)
    fresh = httpx.Client(base_url=provider.url, timeout=5, limits=httpx.Limits(max_keepalive_connections=0))
    try:
        tokens = TokenSource("sms-b", pooled, "/oauth/token", "id", "secret", fresh=fresh)
        first = tokens.get()
        tokens.invalidate(first)
        second = tokens.get()
        assert (first, second) == ("tok-1", "tok-3") and provider.answered == [1, 1]
        without_fresh = TokenSource("sms-b", pooled, "/oauth/token", "id", "secret")
        assert without_fresh.get() == "tok-4"  # a new connection: the pooled one was closed
        without_fresh.invalidate("tok-4")
        with pytest.raises(ProviderAuthError, match="unreachable"):
            without_fresh.get()
    finally:
        pooled.close()
        fresh.close()
        provider.stop()


def test_a_provider_with_tokens_asks_for_a_token_again_on_a_new_connection():
    """Given an SMS provider with short-lived tokens that closes a connection when its third request arrives,
    unanswered,
    When an SMS is sent (a token request and the SMS on one connection), the token is dropped (as after a
    401), and a second SMS is sent (its token request meets the closed connection),
    Then the second SMS is delivered: the adapter's token source asked again on a new connection."""
    provider = Provider(answered_per_connection=2)
    adapter = SmsGatewayB(REGISTRY.providers["sms-b"], provider.url, {"client_id": "id", "client_secret": "s"})
    try:
        first = adapter.post("/v2/messages", b"{}", "unused", "send-1")
        adapter.tokens.invalidate(adapter.tokens.get())
        second = adapter.post("/v2/messages", b"{}", "unused", "send-2")
    finally:
        adapter.close()
        provider.stop()
    assert (first.outcome, second.outcome) == ("delivered", "delivered"), second
    assert provider.keys == ["token", "send-1", "token", "token", "send-2"]
    assert provider.answered == [2, 1, 1]  # the closed one, the token asked again, the second SMS
