"""A provider request's timeout bounds the whole answer, not only each read: a body that arrives a byte at a time
(a stuck upstream behind a proxy) ends the request as an unknown outcome when its time is up; an answer whose whole
body is in is used, however late. And answers and credentials of odd shapes: an endless body, a charset the body is
not in, a message id too long to keep, a key or token an HTTP header cannot carry."""

import contextlib
import gzip
import socketserver
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from streams.errors import ConfigError, ProviderAuthError
from streams.providers import connections
from streams.providers.outcome import message_ids
from streams.providers.registry import ProviderCredentials, load_registry
from streams.providers.resend import ResendEmail
from streams.providers.sms_b import SmsGatewayB
from streams.providers.tokens import TokenSource

RESEND = load_registry().providers["resend"]
DRIP_S = 0.3  # between two bytes of the body: never silent for a whole timeout


class Answering(socketserver.StreamRequestHandler):
    """Reads one request, then answers 200 with `body`, `drip_s` between two of its bytes (0: all at once)."""

    body = b'{"id": "m1"}'
    drip_s = 0.0

    def read_request(self) -> bool:
        """Reads one request, head and body (False: the client closed first)."""
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            line = self.rfile.readline()
            if not line:
                return False
            head += line
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        self.rfile.read(length)
        return True

    def handle(self) -> None:
        if not self.read_request():
            return
        self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                         % len(self.body))
        try:
            for chunk in ([self.body[i:i + 1] for i in range(len(self.body))] if self.drip_s else [self.body]):
                self.wfile.write(chunk)
                self.wfile.flush()
                time.sleep(self.drip_s)
        except OSError:
            return  # the client gave up


class Dripping(Answering):
    body = b'{"id": "m1"}' + b" " * 28
    drip_s = DRIP_S


@contextlib.contextmanager
def provider_answering(handler: type[Answering]) -> Iterator[ResendEmail]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    provider = ResendEmail(RESEND, f"http://127.0.0.1:{server.server_address[1]}", timeout_s=1.0, concurrency=1)
    try:
        yield provider
    finally:
        provider.close()
        server.shutdown()
        server.server_close()


def test_a_provider_answer_dripping_past_the_timeout_ends_the_request_as_an_unknown_outcome():
    """Given a provider that answers 200 and then sends its body a byte every 0.3 s (12 s in all),
    When an email is sent to it with a timeout of 1 s,
    Then the request ends within a few timeouts, its outcome unknown (the provider may have taken it: it
    is asked again under its key), not after the whole body (before: 12 s, and as long as the sender went on)."""
    with provider_answering(Dripping) as provider:
        started = time.monotonic()
        result = provider.post("/emails", b"{}", "re_key", "send-x")
        took = time.monotonic() - started
    assert (result.outcome, result.error_name) == ("unknown", "timeout")
    assert took < 5  # of 12


def test_a_whole_answer_arriving_after_the_requests_time_ran_out_is_used():
    """Given a provider that answers 200 with its whole body, read when the request's time has already run out (a
    token fetch before it took the budget),
    When the answer is read,
    Then it is used: delivered (not thrown away as a timeout, which would send the message round a retry tier)."""
    with provider_answering(Answering) as provider:
        answer = connections.post(provider.client, provider.fresh, "/emails", b"{}", {"Idempotency-Key": "send-x"},
                                  lambda: -1.0, lambda: False)
    assert (answer.status_code, answer.content) == (200, b'{"id": "m1"}')


class Endless(Answering):
    """Answers `status` with a body that never ends (a declared 10 GiB of spaces after `body`), as fast as the
    client reads it."""

    status = b"200 OK"

    def handle(self) -> None:
        if not self.read_request():
            return
        self.wfile.write(b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                         % (self.status, 10 << 30) + self.body)
        spaces = b" " * 65_536
        try:
            while True:
                self.wfile.write(spaces)
        except OSError:
            return  # the client stopped reading


class EndlessUnavailable(Endless):
    status = b"503 Service Unavailable"
    body = b'{"name": "overloaded"}'


def test_an_endless_answer_is_cut_and_read_by_its_status_not_held_until_the_timeout():
    """Given a provider (or a proxy before it) whose answer's body never ends, arriving as fast as it is read,
    When an email is sent to it,
    Then the body is cut at a MiB: a 2xx is an unknown outcome, its answer too large (asked again under its key), and
    a 503 is read by its status and error name (before: every byte was held until the request's time ran out, gigabytes at
    loopback speed, 32 requests at once; and the 503 became a timeout, an unknown outcome)."""
    with provider_answering(Endless) as provider:
        result = provider.post("/emails", b"{}", "re_key", "send-x")
    assert (result.outcome, result.error_name) == ("unknown", "answer_too_large")
    with provider_answering(EndlessUnavailable) as provider:
        result = provider.post("/emails", b"{}", "re_key", "send-x")
    assert (result.status, result.error_name) == (503, "overloaded")


class Canned(Answering):
    """Answers `status` with `headers` and `body`, all at once."""

    status = b"200 OK"
    headers = b"Content-Type: application/json\r\n"

    def handle(self) -> None:
        if self.read_request():
            self.wfile.write(b"HTTP/1.1 %s\r\n%sContent-Length: %d\r\n\r\n%s"
                             % (self.status, self.headers, len(self.body), self.body))


class ThrottledInUtf32(Canned):
    """A 429 whose Content-Type claims a charset its (UTF-8) body is not in."""

    status = b"429 Too Many Requests"
    headers = b"Content-Type: application/json; charset=utf-32\r\nRetry-After: 7\r\n"
    body = b'{"name": "rate_limit_exceeded", "message": "slow down"}'


class ThrottledInBase64(ThrottledInUtf32):
    """A 429 whose Content-Type names a codec that is no text encoding."""

    headers = b"Content-Type: application/json; charset=base64\r\nRetry-After: 7\r\n"


@pytest.mark.parametrize("answering", [ThrottledInUtf32, ThrottledInBase64])
def test_a_429_whose_charset_does_not_match_its_body_is_still_a_429(answering):
    """Given a provider answering 429 (Retry-After 7) with a body its Content-Type says is UTF-32 and is not,
    When an email is sent,
    Then the answer is a throttle with its ask (before: decoding the excerpt raised, the answer lost as an unknown
    outcome: no cool-down, the request asked again)."""
    with provider_answering(answering) as provider:
        result = provider.post("/emails", b"{}", "re_key", "send-x")
    assert (result.outcome, result.status, result.retry_after) == ("throttled", 429, "7")
    assert "slow down" in result.error_body


class LongId(Answering):
    body = b'{"id": "' + b"m" * 300 + b'"}'


def test_an_answer_naming_a_message_id_too_long_to_keep_is_unreadable():
    """Given a provider answering 200 with a message id of 300 characters (or 1.6 million),
    When an email is sent,
    Then its outcome is unknown, its body unreadable (asked again under its key; dead-lettered `unknown_outcome` in
    the end, for an operator), not delivered with an id that made its outcome record too large for the broker
    (the worker stopped, and read the same send again at every restart)."""
    with provider_answering(LongId) as provider:
        result = provider.post("/emails", b"{}", "re_key", "send-x")
    assert (result.outcome, result.error_name) == ("unknown", "unreadable_body")
    assert message_ids(b'{"id": "' + b"m" * 256 + b'"}') == ("m" * 256,)
    for unusable in (b'{"id": false}', b'{"id": {}}', b'{"data": [{"id": "m1"}, {"id": [1]}]}'):
        with pytest.raises((TypeError, ValueError)):
            message_ids(unusable)


def test_a_key_an_http_header_cannot_carry_is_refused_at_start_and_never_counted_as_sent():
    """Given a tenant's API key with a trailing space (a paste), or a line break,
    Then the credentials are refused when a role starts, naming the tenant and not the key; and a request whose
    header could not be written (a token so issued) never reached the provider: unavailable, retried (before: an
    unknown outcome, dead-lettered `unknown_outcome` at the end as if it might have been delivered)."""
    for bad in ("re_abc ", "re_abc\nX-Injected: 1", "re_abcé"):
        with pytest.raises(ConfigError, match="'acme'") as refused:
            ProviderCredentials({"*": "re_default", "acme": bad})
        assert bad not in str(refused.value)
    with provider_answering(Answering) as provider:
        result = provider.post("/emails", b"{}", "re_abc\n", "send-x")
    assert result.outcome == "unavailable"


def test_a_token_an_http_header_cannot_carry_is_no_token():
    """A token endpoint issuing an access token with a line break: refused as no usable token (the send endpoint is
    never called with it), its value not in the error."""
    answer = httpx.Response(200, json={"access_token": "t0k3n\r\nX-Injected: 1", "expires_in": 300})
    client = httpx.Client(base_url="http://provider.test", transport=httpx.MockTransport(lambda request: answer))
    with client, pytest.raises(ProviderAuthError, match="cannot carry") as refused:
        TokenSource("sms-b", client, "/oauth/token", "id", "secret").get()
    assert "t0k3n" not in str(refused.value)


class EchoingInUtf16(Canned):
    """A 401 in UTF-16 (as its Content-Type says) echoing the key the request carried."""

    status = b"401 Unauthorized"
    headers = b"Content-Type: application/json; charset=utf-16\r\n"
    body = '{"name": "invalid_api_key", "message": "key re_s3cr3tkey0123 is not valid"}'.encode("utf-16")


def test_a_key_echoed_in_an_answer_in_another_charset_is_masked():
    """An error answer in UTF-16 echoing the request's key: read in its charset, so the key is found and masked (read
    as UTF-8, its letters came NUL-separated and passed the redaction into logs and dead-letter headers)."""
    with provider_answering(EchoingInUtf16) as provider:
        result = provider.post("/emails", b"{}", "re_s3cr3tkey0123", "send-x")
    assert result.outcome == "auth" and "is not valid" in result.error_body
    assert "s3cr3t" not in result.error_body.replace("\x00", ""), result.error_body


class Gzipped(Canned):
    """A 200 compressed though the request asked for it uncompressed."""

    headers = b"Content-Type: application/json\r\nContent-Encoding: gzip\r\n"
    body = gzip.compress(b'{"id": "m1"}' + b" " * 10_000_000)


def test_an_answer_compressed_though_asked_plain_is_not_decoded():
    """A 200 gzipped to 10 kB from 10 MB (it could as well be 1 GB from 1 MiB): the request asks for an answer
    uncompressed and never decodes one, which reads as unreadable: an unknown outcome, asked again under its key
    (before: decoded whole in the worker)."""
    with provider_answering(Gzipped) as provider:
        result = provider.post("/emails", b"{}", "re_key", "send-x")
    assert (result.outcome, result.error_name) == ("unknown", "unreadable_body")


def test_an_sms_answer_naming_no_sid_names_no_message_and_an_odd_one_is_unreadable():
    """SMS gateway B's answer whose `sid` is missing, null or empty names no message (rejected, the next provider may
    take it); a sid is kept as text; one that is no id (false, a list, an object) makes the answer unreadable (an
    unknown outcome, asked again under its key), never "no message", which a replay or the next provider would send
    again."""
    gateway = SmsGatewayB.__new__(SmsGatewayB)
    assert gateway.parse_ids(b'{"message": {}}') == ("",)
    for sid in ("null", '""'):
        assert gateway.parse_ids(b'{"message": {"sid": %s}}' % sid.encode()) == ("",)
    assert gateway.parse_ids(b'{"message": {"sid": "SM1"}}') == ("SM1",)
    assert gateway.parse_ids(b'{"message": {"sid": 0}}') == ("0",)
    for sid in ("false", "[]", "{}"):
        with pytest.raises(TypeError):
            gateway.parse_ids(b'{"message": {"sid": %s}}' % sid.encode())
