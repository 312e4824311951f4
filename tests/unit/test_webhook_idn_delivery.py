"""An endpoint on an internationalised host name is delivered to: the URL check, the pinned resolver and
the HTTP client agree on the name (IDNA 2008). A real aiohttp client, a real HTTP receiver and a real name
server on loopback (tests/nameserver.py), which knows only the ASCII names."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from streams.webhooks.delivery import WebhookDelivery
from streams.webhooks.model import Endpoint, Secret
from streams.webhooks.ssrf import UrlPolicy
from tests.nameserver import LoopbackNameServer


class Receiver(BaseHTTPRequestHandler):
    seen: list[str] = []

    def do_POST(self):  # noqa: N802 - the http.server hook's name
        self.rfile.read(int(self.headers["content-length"]))
        Receiver.seen.append(self.headers["host"])
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


@pytest.mark.parametrize("host", ["faß.test", "bücher.test"])
def test_an_endpoint_on_an_internationalised_host_is_delivered_to(receiver, host):
    """Given an endpoint at http://<host>:<port>/hooks whose ASCII (IDNA 2008) name resolves to the receiver,
    When a delivery is made,
    Then it is delivered, the receiver asked for by the ASCII name (before, the check and the lookup used the
    name as written, which Python's resolver encodes by IDNA 2003 (`faß.test` becomes `fass.test`, another
    domain), and the client's connection asked for a name nobody had approved: no attempt was delivered)."""
    nameserver = LoopbackNameServer(names={"xn--fa-hia.test": "127.0.0.1", "xn--bcher-kva.test": "127.0.0.1"})
    ep = Endpoint(id="ep_1", tenant="acme", url=f"http://{host}:{receiver}/hooks", event_types=("*",),
                  secrets=(Secret("whsec_" + "A" * 32),))
    directory = SimpleNamespace(get=lambda endpoint_id: ep if endpoint_id == ep.id else None, close=lambda: None)
    d = WebhookDelivery(directory, UrlPolicy(require_https=False, allow=frozenset({"127.0.0.1"})), timeout_s=5,
                        nameservers=[nameserver.address])
    try:
        result = d.submit(ep.id, b'{"type": "invoice.paid"}', "", "send-0001", ep.tenant).result(10)
    finally:
        d.close()
        nameserver.close()
    assert (result.outcome, result.status) == ("delivered", 200), result
    assert Receiver.seen[-1].startswith("xn--")  # the receiver was asked for by its ASCII name
