"""A tenant's name server that never answers costs only that tenant's deliveries a bounded time: name
lookups are made by c-ares on the deliveries' event loop (no thread waits for a name server), one per host
however many deliveries wait for it, each waited for at most DNS_TIMEOUT_S, and the attempt's time budget
includes the lookup. The resolver is the real one, asking a name server on loopback (tests/nameserver.py)."""

import asyncio
import time

import aiodns
import aiohttp
import pytest

from streams.stamped import StampedTable
from streams.webhooks import delivery, lookups
from streams.webhooks.delivery import WebhookDelivery, post_delivery
from tests.nameserver import LoopbackNameServer

ADDRESS = "93.184.216.34"


class Lookups:
    """A name service: `slow.example` answers only once released; anything else at once."""

    def __init__(self):
        self.asked: list[str] = []
        self.release = asyncio.Event()

    async def __call__(self, names, host: str, within_s: float = 5.0) -> list[str]:
        self.asked.append(host)
        if host.startswith("slow"):
            await self.release.wait()
        return [ADDRESS]


def _delivery(loop, nameserver: LoopbackNameServer | None = None) -> WebhookDelivery:
    d = WebhookDelivery.__new__(WebhookDelivery)  # only its name lookups: no endpoint view, no sessions
    d.loop, d.timeout_s, d._dns, d._looking_up = loop, 10.0, StampedTable(delivery.DNS_TTL_S), {}
    d.names = aiodns.DNSResolver(nameservers=[nameserver.address] if nameserver else None, loop=loop,
                                 timeout=lookups.QUERY_TIMEOUT_S, tries=lookups.QUERY_TRIES)
    return d


def test_a_name_server_that_never_answers_holds_its_deliveries_briefly_and_nobody_elses(monkeypatch):
    """Given a host whose name server does not answer, and 20 deliveries to it at once,
    When they look it up, and a delivery to another host looks that one up meanwhile,
    Then one lookup is made for the 20, each gives up after DNS_TIMEOUT_S (a `dns_timeout` failure of its
    attempt), and the other host resolves at once; once the slow answer comes, it is used from the cache."""
    monkeypatch.setattr(delivery, "DNS_TIMEOUT_S", 2.0)  # the other host is answered well within it

    async def scenario() -> None:
        lookups = Lookups()
        monkeypatch.setattr(delivery, "addresses_of", lookups)
        d = _delivery(asyncio.get_running_loop())
        started = time.monotonic()
        slow = [asyncio.ensure_future(d._resolve("slow.example")) for _ in range(20)]
        fast = await asyncio.wait_for(d._resolve("fast.example"), 1.0)
        assert fast("fast.example") == [ADDRESS]
        results = await asyncio.gather(*slow, return_exceptions=True)
        assert all(isinstance(r, TimeoutError) for r in results)
        assert time.monotonic() - started < 5.0  # each gave up after DNS_TIMEOUT_S, not the resolver's 15 s
        assert lookups.asked.count("slow.example") == 1
        late = d._looking_up["slow.example"]
        lookups.release.set()
        await late  # its answer is in the cache by now (the cache's callback was registered first)
        assert (await d._resolve("slow.example"))("slow.example") == [ADDRESS]
        assert lookups.asked.count("slow.example") == 1
        await d.names.close()

    asyncio.run(scenario())


def test_the_time_a_lookup_took_comes_out_of_the_attempts_budget():
    """Given an attempt with 10 s in all whose name lookup took 9.7 s, and a receiver answering after 1 s,
    When the delivery is posted,
    Then it fails with a timeout within the 0.3 s left (before, the POST got 10 s of its own)."""

    async def scenario() -> None:
        async def slow_answer(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            await asyncio.sleep(1.0)
            writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(slow_answer, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/hook"
        async with server, aiohttp.ClientSession() as session, aiohttp.ClientSession() as fresh:
            posted = time.monotonic()
            with pytest.raises(TimeoutError):
                await post_delivery(session, fresh, url, b"{}", {}, time.monotonic() - 9.7, 10.0)
            assert time.monotonic() - posted < 0.8

    asyncio.run(scenario())


def test_many_silent_name_servers_leave_every_other_lookup_free(monkeypatch):
    """Given 300 endpoints (of as many tenants) on hosts whose name servers never answer,
    When deliveries to all 300 look them up, and while they wait another tenant's delivery looks its host up,
    Then the other host resolves at once, and the 300 fail `dns_timeout` after DNS_TIMEOUT_S (before, lookups
    ran on 32 threads, each kept until the system resolver gave up: 8 tenants' silent name servers held all of
    them, and every other tenant's lookup waited and failed too)."""
    # The fast lookup gets 1.5 s of the silent ones' 2 s: what it must not wait for is their timeout, and a loaded
    # machine (300 queries to a Python name server first) can take more than a few hundred milliseconds.
    monkeypatch.setattr(delivery, "DNS_TIMEOUT_S", 2.0)
    silent = {f"silent{i}.example" for i in range(300)}
    with LoopbackNameServer(names={"fast.example": ADDRESS}, silent=silent) as nameserver:

        async def scenario() -> None:
            d = _delivery(asyncio.get_running_loop(), nameserver)
            waiting = [asyncio.ensure_future(d._resolve(host)) for host in sorted(silent)]
            await asyncio.sleep(0)  # every silent lookup has started
            fast = await asyncio.wait_for(d._resolve("fast.example"), 1.5)
            assert fast("fast.example") == [ADDRESS]
            assert not any(w.done() for w in waiting)  # the silent ones were all still waiting meanwhile
            results = await asyncio.gather(*waiting, return_exceptions=True)
            assert all(isinstance(r, TimeoutError) for r in results)
            assert all(nameserver.asked[host] for host in silent)  # each was asked for, none answered
            await d.names.close()

        asyncio.run(scenario())


def test_a_tenants_many_hosts_that_answer_all_resolve():
    """Given one event fanned out to 12 of a tenant's endpoints on 12 hosts not yet looked up,
    When the 12 deliveries look their hosts up at once,
    Then all 12 resolve (none fails: a failed attempt would count towards degrading its endpoint)."""
    hosts = [f"host{i}.example" for i in range(12)]
    with LoopbackNameServer(names=dict.fromkeys(hosts, ADDRESS)) as nameserver:

        async def scenario() -> None:
            d = _delivery(asyncio.get_running_loop(), nameserver)
            resolved = await asyncio.gather(*(d._resolve(host) for host in hosts))
            assert [r(host) for host, r in zip(hosts, resolved, strict=True)] == [[ADDRESS]] * 12
            await d.names.close()

        asyncio.run(scenario())


def test_a_name_answered_slowly_resolves_after_the_resolver_saw_fast_answers():
    """Given a resolver that has just seen 50 names answered at once (c-ares then waits less for an answer,
    down to about 250 ms), and a host whose name servers take 0.8 s,
    When a delivery looks that host up,
    Then it resolves, within DNS_TIMEOUT_S (before, c-ares gave up after about half a second and the
    attempt failed `dns_lookup_failed`, every attempt, counting towards degrading the endpoint)."""
    fast = [f"fast{i}.example" for i in range(50)]
    with LoopbackNameServer(names={**dict.fromkeys(fast, ADDRESS), "slow.example": ADDRESS},
                            slow={"slow.example": 0.8}) as nameserver:

        async def scenario() -> None:
            d = _delivery(asyncio.get_running_loop(), nameserver)
            for host in fast:
                assert (await d._resolve(host))(host) == [ADDRESS]
            assert (await d._resolve("slow.example"))("slow.example") == [ADDRESS]
            await d.names.close()

        asyncio.run(scenario())


def test_a_lookup_ends_within_its_time_whatever_the_resolver_would_wait():
    """Given a resolver that has seen no answer yet (c-ares then waits 1 + 2 + 4 + 8 s for a silent name server),
    When a host whose name server never answers is looked up with 1 s to spare,
    Then the lookup fails within about that second (before, it went on for the resolver's 15 s: a delivery to the
    host meanwhile joined it and failed `dns_timeout` although a new lookup might have been answered)."""
    with LoopbackNameServer(silent={"silent.example"}) as nameserver:

        async def scenario() -> float:
            d = _delivery(asyncio.get_running_loop(), nameserver)
            started = time.monotonic()
            try:
                with pytest.raises(lookups.LookupFailed, match="no answer within 1 s"):
                    await lookups.addresses_of(d.names, "silent.example", within_s=1.0)
                return time.monotonic() - started
            finally:
                await d.names.close()

        assert asyncio.run(scenario()) < 2.0


def test_answers_for_hosts_no_longer_sent_to_are_not_kept(monkeypatch):
    """Given a worker that looked up 3,000 hosts (a tenant sending to new names under its wildcard DNS), then, past
    the answers' time to live, 1,200 others,
    When its cached answers are counted,
    Then only the 1,200 are kept (before: an answer for every host ever looked up, for as long as it ran)."""
    clock = [1000.0]
    monkeypatch.setattr(delivery.time, "monotonic", lambda: clock[0])

    async def scenario() -> None:
        monkeypatch.setattr(delivery, "addresses_of", Lookups())
        d = _delivery(asyncio.get_running_loop())
        for i in range(3000):
            await d._resolve(f"r{i}.tenant.test")
        clock[0] += delivery.DNS_TTL_S + 1
        for i in range(3000, 4200):
            await d._resolve(f"r{i}.tenant.test")
        assert set(d._dns) == {f"r{i}.tenant.test" for i in range(3000, 4200)}

    asyncio.run(scenario())
