"""Where webhooks may not go, decided with a fake resolver (no traffic to private ranges, ever)."""

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from streams.webhooks import lookups
from streams.webhooks.endpoints import EndpointStore
from streams.webhooks.ssrf import UnsafeUrl, UrlPolicy
from tests.nameserver import LoopbackNameServer

DNS = {"hooks.example.com": ["93.184.216.34"], "inside.example.com": ["10.0.0.7"],
       "meta.example.com": ["169.254.169.254"], "dual.example.com": ["93.184.216.34", "192.168.1.2"],
       "v6.example.com": ["::1"], "mapped.example.com": ["::ffff:127.0.0.1"], "cgnat.example.com": ["100.64.1.1"],
       # A resolver that would answer for a bracketed name (c-ares asks nothing for one today; another might):
       "v1.a:b.hooks.example.com": ["93.184.216.34"]}


def resolve(host):
    if host not in DNS:
        raise OSError("no such host")
    return DNS[host]


@pytest.mark.parametrize("url, why", [
    ("http://hooks.example.com/x", "must use https"),
    ("https://inside.example.com/x", "private"),
    ("https://meta.example.com/latest", "cloud metadata"),
    ("https://dual.example.com/x", "private"),            # one bad address is enough
    ("https://v6.example.com/x", "loopback"),
    ("https://mapped.example.com/x", "loopback"),
    ("https://cgnat.example.com/x", "private"),
    ("https://127.0.0.1:8443/x", "loopback"),
    ("https://[fe80::1]/x", "link-local"),
    ("https://224.0.0.1/x", "multicast"),
    ("https://0.0.0.0/x", "unspecified"),
    ("https://nowhere.example.com/x", "does not resolve"),
    ("https://[2002:a9fe:a9fe::1]/x", "cloud metadata"),  # 6to4 around 169.254.169.254
    ("https://[2002:0a00:0007::1]/x", "private"),  # 6to4 around 10.0.0.7
    ("https://[2001:0:4136:e378:8000:63bf:f5ff:fffe]/x", "private"),  # Teredo: client 10.0.0.1
    ("https://[64:ff9b::7f00:1]/x", "loopback"),  # NAT64 around 127.0.0.1
    ("https://[fec0::1]/x", "private"),  # IPv6 site-local
    ("https://168.63.129.16/x", "cloud metadata"),  # Azure's platform address
    ("https://[3fff::1]/x", "non-public"),  # IPv6 documentation (RFC 9637)
    ("https://[2001:db8::1]/x", "private"),  # Python's tables call documentation and benchmarking private
    ("https://192.0.2.10/x", "private"),
    ("https://198.18.0.1/x", "private"),
    ("https://user:pw@hooks.example.com/x", "credentials"),
    ("https://hooks.example.com:0/x", "port is a number from 1"),
    ("https://hooks.example.com:99999/x", "port is a number from 1"), ("https://hooks.example.com:abc/x", "port"),
    ("ftp://hooks.example.com/x", "not an http"),
    # IPv4 in other forms: resolvers read them variously (177.0.0.1 for one), the delivery client refuses them all
    ("https://0177.0.0.1/x", "octal or hex form"),
    ("https://127.1/x", "octal or hex form"),
    ("https://2130706433/x", "octal or hex form"),
    ("https://0x7f.0.0.1/x", "octal or hex form"),
    # A bracketed host that is no address: the delivery client would connect to it without the pinned resolver
    ("https://[v1.a:b.hooks.example.com]/x", "neither a name nor an IP address"),
])
def test_unsafe_urls_are_refused_with_the_reason(url, why):
    with pytest.raises(UnsafeUrl, match=why):
        UrlPolicy().check(url, resolve)


def test_public_https_and_operator_allowed_hosts_pass():
    UrlPolicy().check("https://hooks.example.com/x", resolve)
    for public in ("8.8.8.8", "1.1.1.1", "[2606:4700:4700::1111]", "[2a00:1450:4001:80b::200e]"):
        UrlPolicy().check(f"https://{public}/x", resolve)
    UrlPolicy(require_https=False, allow=frozenset({"127.0.0.1"})).check("http://127.0.0.1:9000/hooks/a", resolve)


def test_a_refusal_never_names_the_address_a_name_resolved_to_nor_the_resolvers_error():
    """A tenant reads these reasons: they must not map our internal names for it."""
    for url, hidden in (("https://inside.example.com/x", "10.0.0.7"), ("https://nowhere.example.com/x", "no such")):
        with pytest.raises(UnsafeUrl) as refused:
            UrlPolicy().check(url, resolve)
        assert hidden not in str(refused.value)


def test_a_registration_whose_name_server_never_answers_is_refused_in_seconds(monkeypatch):
    """Given a host whose name server does not answer,
    When a tenant registers a URL on it,
    Then the registration is refused as not resolving after BLOCKING_TIMEOUT_S, instead of holding one of the
    API's request threads until the system resolver gives up (tenants share those threads)."""
    monkeypatch.setattr(lookups, "BLOCKING_TIMEOUT_S", 0.3)
    with LoopbackNameServer(silent={"slow.example"}) as nameserver:
        resolver = lookups.BlockingResolver([nameserver.address])
        started = time.monotonic()
        try:
            with pytest.raises(UnsafeUrl, match="does not resolve"):
                UrlPolicy().check("https://slow.example/hook", resolver)
            assert time.monotonic() - started < 1.0
        finally:
            resolver.close()


def test_many_registrations_on_silent_name_servers_leave_another_tenants_registration_free(monkeypatch):
    """Given 100 registrations at once on hosts whose name servers never answer (each waiting in its API thread),
    When another tenant registers a URL on a host that answers, meanwhile,
    Then its lookup answers at once (before, lookups ran on 32 threads of their own, each kept until the system
    resolver gave up: 32 such registrations held them all, and every other registration was refused as not
    resolving for as long)."""
    monkeypatch.setattr(lookups, "BLOCKING_TIMEOUT_S", 2.0)
    silent = [f"silent{i}.example" for i in range(100)]
    with LoopbackNameServer(names={"fast.example": "93.184.216.34"}, silent=set(silent)) as nameserver, \
            ThreadPoolExecutor(100) as api_threads:
        resolver = lookups.BlockingResolver([nameserver.address])
        try:
            waiting = [api_threads.submit(resolver, host) for host in silent]
            while sum(nameserver.asked[host] > 0 for host in silent) < len(silent):
                assert not any(w.done() for w in waiting)  # (they all wait, as the API's threads would)
                time.sleep(0.01)
            assert resolver("fast.example") == ["93.184.216.34"]
            assert not any(w.done() for w in waiting)  # answered while all 100 were still waiting
            assert all(isinstance(w.exception(), OSError) for w in waiting)  # TimeoutError or LookupFailed
        finally:
            resolver.close()


def test_an_internationalised_host_is_checked_under_the_name_the_http_client_connects_to():
    """Given `faß.de`, which IDNA 2003 (Python's codec) reads as `fass.de` and IDNA 2008 (the HTTP client's
    URL parser) as `xn--fa-hia.de`, two different domains,
    When its URL is checked,
    Then the name resolved is `xn--fa-hia.de`, the one the delivery will connect to (before, the check
    resolved `fass.de` and approved addresses the connection never asked for)."""
    asked = []

    def recording(host):
        asked.append(host)
        return ["93.184.216.34"]

    UrlPolicy().check("https://faß.de/hooks", recording)
    UrlPolicy().check("https://Bücher.example/hooks", recording)
    assert asked == ["xn--fa-hia.de", "xn--bcher-kva.example"]


@pytest.mark.parametrize("host", ["a..com", "a" * 64 + ".com"])
def test_a_host_no_name_server_can_hold_is_refused_as_not_resolving(host):
    """Given a host with an empty label or one over 63 characters, which no name server can hold,
    When a tenant registers a URL on it,
    Then it is refused as not resolving (a 422 for the tenant; before, the UnicodeError of the system resolver's
    codec escaped the check and the registration was answered 500)."""
    with pytest.raises(UnsafeUrl, match="does not resolve"):
        UrlPolicy().check(f"https://{host}/hooks", lookups.system_resolver)


def test_a_refused_url_is_never_repeated_in_the_reason():
    """A refusal at delivery reaches logs and dead letters; the URL's path or query often holds a token."""
    for url in ("ftp://hooks.example.com/services/T0/B0/secret-token", "https:///secret-token?key=k"):
        with pytest.raises(UnsafeUrl) as refused:
            UrlPolicy().check(url, resolve)
        assert "secret-token" not in str(refused.value) and "not an http(s) URL" in str(refused.value)


def test_a_url_with_an_unclosed_bracket_is_refused_not_a_500():
    with pytest.raises(UnsafeUrl):
        UrlPolicy().check("http://[::1/hooks", lambda host: [])


class CountingResolver:
    """A resolver with an awaitable form, counting the names it was asked for."""

    def __init__(self):
        self.asked: list[str] = []

    def __call__(self, host):
        raise AssertionError("the check must use the answer looked up before")

    async def addresses(self, host):
        self.asked.append(host)
        return ["93.184.216.34"]


@pytest.mark.parametrize("url", ["ftp://example.com/h", "http://example.com/h", "https://u:p@example.com/h",
                                 "https://93.184.216.34/h", "https://hooks.internal/h"],
                         ids=["not http", "http where https is required", "credentials", "an address", "allowed"])
def test_a_url_the_check_settles_without_a_lookup_asks_no_name_server(url):
    """The registration's lookup on the event loop is made only for a URL the check would look up: a URL it
    refuses anyway (or passes without a lookup) asks no name server, and waits for none."""
    resolver = CountingResolver()
    store = EndpointStore(SimpleNamespace(register_script=lambda text: None), "", None,  # type: ignore[arg-type]
                          UrlPolicy(require_https=True, allow=frozenset({"hooks.internal"})), resolver)
    assert asyncio.run(store.url_resolver(url)) is resolver and resolver.asked == []


def test_a_url_the_check_looks_up_is_checked_with_the_answer_looked_up_on_the_loop():
    resolver = CountingResolver()
    store = EndpointStore(SimpleNamespace(register_script=lambda text: None), "", None,  # type: ignore[arg-type]
                          UrlPolicy(), resolver)
    resolve = asyncio.run(store.url_resolver("https://Bücher.example/hooks"))
    assert resolver.asked == ["xn--bcher-kva.example"]
    UrlPolicy().check("https://Bücher.example/hooks", resolve)  # a public address: passes, without asking again
    with pytest.raises(OSError):
        resolve("other.example")
