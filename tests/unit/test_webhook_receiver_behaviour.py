"""What receivers do to the webhook client: set cookies, stall a body after a 2xx, and what a failed name
lookup does. A real aiohttp client (WebhookDelivery), real HTTP receivers on loopback, and a real name server
on loopback for the receivers' names (tests/nameserver.py)."""

import asyncio
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import aiodns
import pytest
from aiodns import error as dns_errors
from prometheus_client import REGISTRY

from streams.providers.outcome import Outbound, UnusablePayload
from streams.webhooks import delivery, lookups
from streams.webhooks.delivery import WebhookDelivery
from streams.webhooks.model import Endpoint, Secret
from streams.webhooks.ssrf import UrlPolicy
from tests.nameserver import LoopbackNameServer


class Receiver(BaseHTTPRequestHandler):
    """Answers 200. `/set-cookies` answers with cookies for its parent domains; `/stall` sends its headers
    (a 100-byte body announced) and then nothing until the test ends; `/stall-410` and `/stall-429` do the same
    with that status (the 429 asking for an hour)."""

    cookies_seen: list[str | None] = []
    release = threading.Event()

    def do_POST(self):  # noqa: N802 - the http.server hook's name
        self.rfile.read(int(self.headers["content-length"]))
        Receiver.cookies_seen.append(self.headers.get("cookie"))
        self.send_response(int(self.path.removeprefix("/stall-")) if self.path.startswith("/stall-") else 200)
        if self.path == "/stall-429":
            self.send_header("retry-after", "3600")
        if self.path == "/set-cookies":
            for domain in ("test", "shared.test", "a.shared.test"):
                self.send_header("set-cookie", f"tossed-{domain}=from-a; Domain={domain}; Path=/")
        if self.path.startswith("/stall"):
            self.send_header("content-length", "100")
            self.end_headers()
            self.wfile.flush()
            Receiver.release.wait(10)
            return
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver():
    Receiver.cookies_seen, Receiver.release = [], threading.Event()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    Receiver.release.set()
    server.shutdown()


@pytest.fixture
def nameserver():
    names = ("a.shared.test", "b.shared.test", "slow.test", "dns.test")
    with LoopbackNameServer(names=dict.fromkeys(names, "127.0.0.1")) as server:
        yield server


def endpoints(*eps: Endpoint):
    by_id = {ep.id: ep for ep in eps}
    return SimpleNamespace(get=by_id.get, close=lambda: None)


def endpoint(ep_id: str, tenant: str, url: str) -> Endpoint:
    return Endpoint(id=ep_id, tenant=tenant, url=url, event_types=("*",), secrets=(Secret("whsec_" + "A" * 32),))


def client(directory, nameserver: LoopbackNameServer | None = None, timeout_s: float = 5) -> WebhookDelivery:
    return WebhookDelivery(directory, UrlPolicy(require_https=False, allow=frozenset({"127.0.0.1"})),
                           timeout_s=timeout_s, nameservers=[nameserver.address] if nameserver else None)


def deliver(d: WebhookDelivery, ep: Endpoint, n: int, tenant: str | None = None):
    return d.submit(ep.id, b'{"type": "invoice.paid"}', "", f"send-{n:04d}", tenant or ep.tenant).result(15)


def test_a_cookie_one_tenants_receiver_sets_never_goes_out_with_another_tenants_delivery(nameserver, receiver):
    """Given tenant a's receiver at a.shared.test, which answers with cookies for `test`, `shared.test` and
    itself, and tenant b's at b.shared.test (both on this machine),
    When a delivery goes to a, then one to b and one more to a,
    Then neither of the later ones carries a cookie (before, the client kept the cookies, shared by every
    tenant: b's receiver got a's cookies, and a receiver could fill another tenant's request headers)."""
    a = endpoint("ep_a", "acme", f"http://a.shared.test:{receiver}/set-cookies")
    b = endpoint("ep_b", "globex", f"http://b.shared.test:{receiver}/hooks")
    d = client(endpoints(a, b), nameserver)
    try:
        results = [deliver(d, a, 1), deliver(d, b, 2), deliver(d, a, 3)]
    finally:
        d.close()
    assert [r.outcome for r in results] == ["delivered"] * 3
    assert Receiver.cookies_seen == [None, None, None]


def test_a_2xx_whose_body_stalls_is_delivered_not_a_timeout(nameserver, receiver):
    """Given a receiver that answers 200 and then sends none of the body it announced (a handler that
    answers first and works after),
    When a delivery is made with a 3 s timeout,
    Then it is delivered, within about a second (before, the client waited for the body's first bytes and
    the attempt failed as a Timeout: the receiver got the event again and its endpoint's health suffered)."""
    ep = endpoint("ep_s", "acme", f"http://slow.test:{receiver}/stall")
    d = client(endpoints(ep), nameserver, timeout_s=3)
    try:
        started = time.monotonic()
        result = deliver(d, ep, 1)
        took = time.monotonic() - started
    finally:
        d.close()
    assert (result.outcome, result.status) == ("delivered", 200), result
    assert took < delivery.DRAIN_S + 1.0


def test_a_failed_name_lookup_is_not_remembered(nameserver, receiver):
    """Given a name server that answers SERVFAIL for the receiver's name, and then answers again,
    When a delivery meets the failure and the next one follows once it answers,
    Then the first fails as `dns_lookup_failed` (retried by the schedule), and the second looks the name up
    again and is delivered (before, the failure was cached as "does not resolve" for 30 s: every delivery to
    the host failed at once as unsafe_url, and a queue of ten degraded the endpoint)."""
    ep = endpoint("ep_d", "acme", f"http://dns.test:{receiver}/hooks")
    d = client(endpoints(ep), nameserver)
    try:
        nameserver.failing.add("dns.test")
        first = deliver(d, ep, 1)
        nameserver.failing.clear()
        second = deliver(d, ep, 2)
    finally:
        d.close()
    assert (first.outcome, first.error_name) == ("unavailable", "dns_lookup_failed"), first
    assert second.outcome == "delivered", second


class FlakyNames:
    """A resolver failing `failures` lookups (SERVFAIL), then answering."""

    def __init__(self, failures: int):
        self.failures, self.asked = failures, 0

    async def getaddrinfo(self, host, family=0):
        self.asked += 1
        if self.asked <= self.failures:
            raise dns_errors.DNSError(dns_errors.ARES_ESERVFAIL, "Server failure")
        return SimpleNamespace(nodes=[SimpleNamespace(addr=(b"127.0.0.1", 0))])


@pytest.mark.parametrize("failures, found", [(1, ["127.0.0.1"]), (2, None)], ids=["once", "twice"])
def test_a_failed_lookup_is_tried_once_more(failures, found):
    """A name server's bad moment passes: a lookup that fails is made once more before the attempt fails."""
    names = FlakyNames(failures)
    if found is None:
        with pytest.raises(lookups.LookupFailed, match="Server failure"):
            asyncio.run(lookups.addresses_of(names, "dns.test"))
    else:
        assert asyncio.run(lookups.addresses_of(names, "dns.test")) == found
    assert names.asked == 2


@pytest.mark.parametrize("host", ["gone.test", "a" * 70 + ".test"], ids=["NXDOMAIN", "a label over 63"])
def test_a_name_that_does_not_exist_is_an_answer_not_a_failed_lookup(nameserver, host):
    """NXDOMAIN, or a name no name server can hold: the host does not resolve (the tenant's URL), which the
    URL check refuses and the endpoint's health counts."""
    async def look_up() -> list[str]:
        names = aiodns.DNSResolver(nameservers=[nameserver.address], loop=asyncio.get_running_loop())
        try:
            return await lookups.addresses_of(names, host)
        finally:
            await names.close()

    assert asyncio.run(look_up()) == []


def test_an_event_naming_another_tenants_endpoint_is_never_built():
    """Given globex's endpoint, and an event of acme's (written to the lane topic past ingest) naming it,
    When the worker builds its request,
    Then it is refused with a reason the dead letter can carry, and acme's own endpoint builds."""
    theirs, ours = endpoint("ep_g", "globex", "http://g.test/h"), endpoint("ep_a", "acme", "http://a.test/h")
    d = client(endpoints(theirs, ours))
    payload = {"event_type": "invoice.paid", "occurredAt": "2026-12-03T00:00:00Z", "data": {}}
    try:
        with pytest.raises(UnusablePayload, match="'ep_g' is not this tenant's"):
            d.build([Outbound("s1", "acme", "transactional", {**payload, "endpoint_id": "ep_g"})], batch=False)
        assert d.build([Outbound("s2", "acme", "transactional", {**payload, "endpoint_id": "ep_a"})], False)[0] == "ep_a"
    finally:
        d.close()


class LaggingView:
    """An endpoint view that has not read the newest endpoints yet: `sync` brings it up to the log's end (the
    worker's poll thread reading on), or cannot (`reachable` False: the broker did not say where the end is)."""

    def __init__(self, known: list[Endpoint], behind: list[Endpoint], reachable: bool = True):
        self.by_id, self.behind, self.reachable = {ep.id: ep for ep in known}, behind, reachable

    def get(self, endpoint_id: str):
        return self.by_id.get(endpoint_id)

    def sync(self, timeout_s: float) -> bool:
        if self.reachable:
            self.by_id.update({ep.id: ep for ep in self.behind})
        return self.reachable

    def close(self) -> None:
        pass


def test_an_endpoint_the_view_has_not_read_yet_is_delivered_to_not_taken_for_deleted(nameserver, receiver):
    """Given a worker whose endpoint view has not yet read a just-created endpoint (the lane's record of its first
    delivery came before the operator log's record of the endpoint), and an endpoint that was deleted,
    When a delivery goes to each, and then to the new one while the broker cannot say where the log ends,
    Then the new endpoint's delivery is delivered once the view has read the log to its end (before: skipped for
    good as `endpoint_deleted`); the deleted one's is skipped as deleted; with the log's end unknown the delivery
    is retried (`endpoint_view_behind`, which is not the endpoint's failure), not skipped."""
    new = endpoint("ep_new", "acme", f"http://a.shared.test:{receiver}/hooks")
    d = client(LaggingView([], [new]), nameserver)
    try:
        results = [deliver(d, new, 1), deliver(d, endpoint("ep_gone", "acme", "http://gone.test/x"), 2)]
    finally:
        d.close()
    assert [(r.outcome, r.error_name) for r in results] == [("delivered", ""), ("skipped", "endpoint_deleted")]
    d = client(LaggingView([], [new], reachable=False), nameserver)
    try:
        behind = deliver(d, new, 3)
    finally:
        d.close()
    assert (behind.outcome, behind.error_name) == ("unavailable", "endpoint_view_behind")


def test_an_event_naming_another_tenants_endpoint_the_view_had_not_read_is_never_delivered(nameserver, receiver):
    """Given acme's event written to the lane past ingest, naming globex's endpoint, which the worker's view had
    not read when the request was built (so `build` could not refuse it),
    When it is delivered (the view catches up and finds the endpoint), and when a stored request of it is re-sent,
    Then it is rejected as `endpoint_of_another_tenant` and globex's receiver gets nothing (before: it was POSTed
    there, signed with globex's secret); globex's own delivery still goes out."""
    theirs = endpoint("ep_g", "globex", f"http://b.shared.test:{receiver}/hooks")
    d = client(LaggingView([], [theirs]), nameserver)
    try:
        forged = [deliver(d, theirs, 1, tenant="acme"), deliver(d, theirs, 2, tenant="acme")]
        assert Receiver.cookies_seen == []
        own = deliver(d, theirs, 3)
    finally:
        d.close()
    assert [(r.outcome, r.error_name) for r in forged] == [("rejected", "endpoint_of_another_tenant")] * 2
    assert own.outcome == "delivered" and len(Receiver.cookies_seen) == 1


@pytest.mark.parametrize("status, outcome, retry_after", [(410, "gone", None), (429, "throttled", "3600")])
def test_a_refusal_whose_body_stalls_is_taken_by_its_status_not_as_a_timeout(receiver, status, outcome, retry_after):
    """Given a receiver that answers 410 (or 429 asking for an hour) and then stalls its body,
    When a delivery goes to it (a 5 s attempt timeout),
    Then the attempt ends on what the status says (its body waited for a second): `gone` (which disables it) or
    `throttled` with its Retry-After (before: the attempt waited its whole timeout and was recorded as a timeout,
    so a 410 never disabled the endpoint and the hour asked for was not waited)."""
    ep = endpoint("ep_stall", "acme", f"http://127.0.0.1:{receiver}/stall-{status}")
    d = client(endpoints(ep), timeout_s=5)
    try:
        result = deliver(d, ep, 1)
    finally:
        d.close()
    assert (result.outcome, result.status, result.retry_after) == (outcome, status, retry_after)


def closed_port() -> int:
    """A loopback port nothing listens on (a connection to it is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def egress_unavailable_total() -> float:
    return REGISTRY.get_sample_value("webhook_egress_unavailable_total") or 0.0


THREE_NAMES = ("a.shared.test", "b.shared.test", "slow.test")


def three_tenants(port: int, prefix: str = "ep_") -> list[Endpoint]:
    """An endpoint of each of three tenants (tenant-0..2), at THREE_NAMES of the test name server, on `port`."""
    return [endpoint(f"{prefix}{n}", f"tenant-{n}", f"http://{name}:{port}/hooks") for n, name in enumerate(THREE_NAMES)]


def test_our_name_servers_failing_every_receiver_is_taken_for_ours_not_the_endpoints(nameserver, receiver):
    """Given the name server failing (SERVFAIL) for three tenants' receivers' names, as our own name servers
    would during an outage of ours,
    When a delivery goes to each, then the name server answers again and a delivery reaches a fourth receiver,
    and the first receiver's name fails once more,
    Then the first two fail as `dns_lookup_failed` (the receivers', as far as anyone can tell yet), the third
    as `egress_unavailable` (not counted against its endpoint: before, each counted, and an outage long
    enough degraded every endpoint and mailed their tenants); once a receiver answered, a failure is the
    receiver's again."""
    eps = three_tenants(receiver)
    working = endpoint("ep_ok", "tenant-ok", f"http://dns.test:{receiver}/hooks")
    d = client(endpoints(*eps, working), nameserver)
    before = egress_unavailable_total()
    try:
        nameserver.failing.update(THREE_NAMES)
        down = [deliver(d, ep, n) for n, ep in enumerate(eps)]
        nameserver.failing.clear()
        reached = deliver(d, working, 10)
        nameserver.failing.add(THREE_NAMES[0])
        again = deliver(d, eps[0], 11)
    finally:
        d.close()
    assert [(r.outcome, r.error_name) for r in down] == [("unavailable", "dns_lookup_failed")] * 2 + [
        ("unavailable", "egress_unavailable")], down
    assert down[2].error_body.startswith("dns_lookup_failed: receivers of 3 tenants could not be reached"), down[2]
    assert down[2].never_sent is True
    assert reached.outcome == "delivered", reached
    assert (again.outcome, again.error_name) == ("unavailable", "dns_lookup_failed"), again
    assert egress_unavailable_total() - before == 1


def test_refused_connections_are_ours_only_while_no_receiver_answers(nameserver, receiver):
    """Given three tenants' receivers whose names resolve to a port nothing listens on, and one that answers,
    When deliveries go to the three with the working one's in between, and then to the three in a row,
    Then the first round's failures are each receiver's own (ClientConnectorError: the working receiver's
    answer shows the way out works), and in the second round the third refusal is taken for ours."""
    port = closed_port()
    eps = three_tenants(port)
    working = endpoint("ep_ok", "tenant-ok", f"http://dns.test:{receiver}/hooks")
    d = client(endpoints(*eps, working), nameserver)
    try:
        mixed = []
        for n, ep in enumerate(eps):
            mixed.append(deliver(d, ep, n))
            assert deliver(d, working, 10 + n).outcome == "delivered"
        in_a_row = [deliver(d, ep, 20 + n) for n, ep in enumerate(eps)]
    finally:
        d.close()
    assert [r.error_name for r in mixed] == ["ClientConnectorError"] * 3, mixed
    assert [r.error_name for r in in_a_row] == ["ClientConnectorError"] * 2 + ["egress_unavailable"], in_a_row


def test_one_tenants_receivers_refusing_connections_are_never_taken_for_our_egress(nameserver):
    """Given one tenant's four receivers (four names, two ports) that all refuse connections,
    When deliveries go to each of them, twice,
    Then every failure stays the receivers' (ClientConnectorError, counted against their endpoints): one tenant
    cannot switch the egress watch on and so leave other tenants' broken receivers uncounted."""
    ports = (closed_port(), closed_port())
    eps = [endpoint(f"ep_{n}", "acme", f"http://{name}:{ports[n % 2]}/hooks")
           for n, name in enumerate(("a.shared.test", "b.shared.test", "slow.test", "dns.test"))]
    d = client(endpoints(*eps), nameserver)
    try:
        results = [deliver(d, ep, 10 * round + n) for round in range(2) for n, ep in enumerate(eps)]
    finally:
        d.close()
    assert [r.error_name for r in results] == ["ClientConnectorError"] * 8, results


@pytest.fixture
def unanswered_listeners():
    """Two loopback ports: one whose connections never complete (its accept queue full: the kernel drops the
    SYNs, as a firewall dropping our packets would), and one that takes connections and never answers."""
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    filler = socket.create_connection(full.getsockname(), timeout=2)  # fills the queue of one
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    yield full.getsockname()[1], silent.getsockname()[1]
    for s in (filler, full, silent):
        s.close()


def test_connections_that_never_open_are_ours_and_slow_receivers_never(nameserver, unanswered_listeners):
    """Given three tenants' receivers whose connections never open (our packets dropped), and three that take the
    connection and never answer,
    When a delivery with a 1.5 s timeout goes to each of the silent ones, then to each of the unreachable ones,
    Then the silent receivers' timeouts stay theirs (a slow receiver is the receiver's failure), the unreachable
    ones fail as `ConnectTimeout`, and the third of those is taken for ours (`egress_unavailable`): an outage that
    drops packets instead of refusing them is recognised too."""
    full, silent = unanswered_listeners
    slow, dropped = three_tenants(silent, "ep_s"), three_tenants(full, "ep_d")
    d = client(endpoints(*slow, *dropped), nameserver, timeout_s=delivery.CONNECT_TRIED_S + 0.5)
    try:
        timed_out = [deliver(d, ep, n) for n, ep in enumerate(slow)]
        unreached = [deliver(d, ep, 10 + n) for n, ep in enumerate(dropped)]
    finally:
        d.close()
    assert [r.error_name for r in timed_out] == ["Timeout"] * 3, timed_out
    assert [r.error_name for r in unreached] == ["ConnectTimeout", "ConnectTimeout", "egress_unavailable"], unreached
    assert unreached[2].error_body.startswith("ConnectTimeout: receivers of 3 tenants"), unreached[2]


def test_a_receiver_whose_tls_handshake_fails_was_reached(nameserver, receiver):
    """Given two tenants' receivers refusing connections, a receiver that speaks plain HTTP on an https URL (its
    TLS handshake fails: it was reached), and a third tenant's receiver refusing connections,
    When a delivery goes to each in that order,
    Then the third refusal stays its receiver's: the failed handshake showed that the way out works."""
    port = closed_port()
    eps = three_tenants(port)
    tls = endpoint("ep_tls", "tenant-tls", f"https://dns.test:{receiver}/hooks")
    d = client(endpoints(*eps, tls), nameserver)
    try:
        results = [deliver(d, eps[0], 1), deliver(d, eps[1], 2), deliver(d, tls, 3), deliver(d, eps[2], 4)]
    finally:
        d.close()
    assert [r.error_name for r in results] == ["ClientConnectorError"] * 2 + [
        "ClientConnectorSSLError", "ClientConnectorError"], results
