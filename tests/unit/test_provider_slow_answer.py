"""A provider request's timeout bounds the whole answer, not only each read: a body that arrives a byte at a time
(a stuck upstream behind a proxy) ends the request as an unknown outcome when its time is up; an answer whose whole
body is in is used, however late."""

import contextlib
import socketserver
import threading
import time
from collections.abc import Iterator

from streams.providers import connections
from streams.providers.registry import load_registry
from streams.providers.resend import ResendEmail

RESEND = load_registry().providers["resend"]
DRIP_S = 0.3  # between two bytes of the body: never silent for a whole timeout


class Answering(socketserver.StreamRequestHandler):
    """Reads one request, then answers 200 with `body`, `drip_s` between two of its bytes (0: all at once)."""

    body = b'{"id": "m1"}'
    drip_s = 0.0

    def handle(self) -> None:
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            line = self.rfile.readline()
            if not line:
                return
            head += line
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        self.rfile.read(length)
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
