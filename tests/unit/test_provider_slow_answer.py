"""A provider request's timeout bounds the whole answer, not only each read: a body that arrives a byte at a time
(a stuck upstream behind a proxy) ends the request as an unknown outcome when its time is up."""

import socketserver
import threading
import time

from streams.providers.registry import load_registry
from streams.providers.resend import ResendEmail

RESEND = load_registry().providers["resend"]
DRIP_S = 0.3  # between two bytes of the body: never silent for a whole timeout


class Dripping(socketserver.StreamRequestHandler):
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
        body = b'{"id": "m1"}' + b" " * 28
        self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
        try:
            for i in range(len(body)):
                self.wfile.write(body[i:i + 1])
                self.wfile.flush()
                time.sleep(DRIP_S)
        except OSError:
            return  # the client gave up


def test_a_provider_answer_dripping_past_the_timeout_ends_the_request_as_an_unknown_outcome():
    """Given a provider that answers 200 and then sends its body a byte every 0.3 s (12 s in all),
    When an email is sent to it with a timeout of 1 s,
    Then the request ends within a few timeouts, its outcome unknown (the provider may have taken it: it
    is asked again under its key), not after the whole body (before: 12 s, and as long as the sender went on)."""
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Dripping)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    provider = ResendEmail(RESEND, f"http://127.0.0.1:{server.server_address[1]}", timeout_s=1.0, concurrency=1)
    try:
        started = time.monotonic()
        result = provider.post("/emails", b"{}", "re_key", "send-x")
        took = time.monotonic() - started
    finally:
        provider.close()
        server.shutdown()
        server.server_close()
    assert (result.outcome, result.error_name) == ("unknown", "timeout")
    assert took < 5  # of 12


class Prompt(socketserver.StreamRequestHandler):
    """Answers 200 with its whole body at once."""

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
        body = b'{"id": "m1"}'
        self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))


def test_a_whole_answer_arriving_after_the_requests_time_ran_out_is_used():
    """Given a provider that answers 200 with its whole body, read when the request's time has already run out (a
    token fetch before it took the budget),
    When the answer is read,
    Then it is used: delivered (not thrown away as a timeout, which would send the message round a retry tier)."""
    from streams.providers import connections

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Prompt)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    provider = ResendEmail(RESEND, f"http://127.0.0.1:{server.server_address[1]}", timeout_s=1.0, concurrency=1)
    try:
        answer = connections.post(provider.client, provider.fresh, "/emails", b"{}", {"Idempotency-Key": "send-x"},
                                  lambda: -1.0, lambda: False)
    finally:
        provider.close()
        server.shutdown()
        server.server_close()
    assert (answer.status_code, answer.content) == (200, b'{"id": "m1"}')
