"""The webhooks SDK lets an idle connection go before the API's server would close it."""

import http.server
import threading
import time

from streams.providers.connections import KEEPALIVE_S
from streams.webhooks.client import WebhooksClient


class Api(http.server.ThreadingHTTPServer):
    """Answers every GET with no endpoints, keeping connections open; counts the connections."""

    daemon_threads = True
    connections = 0


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    server: Api

    def setup(self) -> None:
        super().setup()
        self.server.connections += 1

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        body = b'{"endpoints": []}'
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_a_call_after_the_keep_alive_goes_out_on_a_new_connection():
    """Given the SDK and an API that keeps connections open,
    When two calls are made at once after another, then a third after the SDK's keep-alive (4 s; uvicorn,
    which serves the API, closes a connection idle for 5 s),
    Then the second reused the first's connection and the third opened a new one: it is never sent on a
    connection the server may be closing at that moment."""
    api = Api(("127.0.0.1", 0), Handler)
    threading.Thread(target=api.serve_forever, daemon=True).start()
    hooks = WebhooksClient(f"http://127.0.0.1:{api.server_address[1]}", "dr_key")
    try:
        assert hooks.endpoints() == [] and hooks.endpoints() == []
        assert api.connections == 1
        time.sleep(KEEPALIVE_S + 0.5)  # the idle time is what is tested, not a wait for something
        assert hooks.endpoints() == []
        assert api.connections == 2
    finally:
        hooks.http.close()
        api.shutdown()
        api.server_close()
