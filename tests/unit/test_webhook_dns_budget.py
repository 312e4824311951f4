"""A tenant's name server that never answers costs only that tenant's deliveries a bounded time: name
lookups run on the deliveries' own threads, one per host however many deliveries wait for it, each
waited for at most DNS_TIMEOUT_S, and the attempt's time budget includes the lookup."""

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pytest

from streams.webhooks import delivery
from streams.webhooks.delivery import WebhookDelivery, post_delivery


class Lookups:
    """A name service: `slow.example` answers only once released; anything else at once."""

    def __init__(self):
        self.asked: list[str] = []
        self.release = threading.Event()

    def __call__(self, host: str) -> list[str]:
        self.asked.append(host)
        if host.startswith("slow"):
            self.release.wait(10)
        return ["93.184.216.34"]


def _delivery(loop, threads: int = 4) -> WebhookDelivery:
    d = WebhookDelivery.__new__(WebhookDelivery)  # only its name lookups: no endpoint view, no sessions
    d.loop, d.timeout_s, d._dns, d._looking_up, d._tenant_slots = loop, 10.0, {}, {}, {}
    d._dns_pool = ThreadPoolExecutor(threads)
    return d


def test_a_name_server_that_never_answers_holds_its_deliveries_briefly_and_nobody_elses(monkeypatch):
    """Given a host whose name server does not answer, and 20 deliveries to it at once,
    When they look it up, and a delivery to another host looks that one up meanwhile,
    Then one lookup is made for the 20, each gives up after DNS_TIMEOUT_S (a `dns_timeout` failure of its
    attempt), and the other host resolves at once; once the slow answer comes, it is used from the cache."""
    lookups = Lookups()
    monkeypatch.setattr(delivery, "addresses_of", lookups)
    monkeypatch.setattr(delivery, "DNS_TIMEOUT_S", 0.3)

    async def scenario() -> None:
        d = _delivery(asyncio.get_running_loop())
        started = time.monotonic()
        slow = [asyncio.ensure_future(d._resolve("slow.example")) for _ in range(20)]
        fast = await asyncio.wait_for(d._resolve("fast.example"), 0.2)
        assert fast("fast.example") == ["93.184.216.34"]
        results = await asyncio.gather(*slow, return_exceptions=True)
        assert all(isinstance(r, TimeoutError) for r in results)
        assert time.monotonic() - started < 2.0
        assert lookups.asked.count("slow.example") == 1
        late = d._looking_up["slow.example"]
        lookups.release.set()
        await late  # its answer is in the cache by now (the cache's callback was registered first)
        assert (await d._resolve("slow.example"))("slow.example") == ["93.184.216.34"]
        assert lookups.asked.count("slow.example") == 1
        d._dns_pool.shutdown(wait=False)

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


def test_one_tenants_silent_name_servers_hold_a_few_lookup_threads_not_all(monkeypatch):
    """Given a tenant whose 20 endpoints are on 20 hosts whose name servers never answer (each lookup keeps its
    thread until the system resolver gives up),
    When deliveries to all 20 look them up, and then another tenant's delivery looks its host up,
    Then at most DNS_LOOKUPS_PER_TENANT lookups of the first tenant run (the others wait for one to end, and
    fail `dns_timeout` after DNS_TIMEOUT_S), and the other tenant's host resolves at once: it found a thread
    free."""
    lookups = Lookups()
    monkeypatch.setattr(delivery, "addresses_of", lookups)
    monkeypatch.setattr(delivery, "DNS_TIMEOUT_S", 0.3)

    async def scenario() -> None:
        d = _delivery(asyncio.get_running_loop(), threads=2 * delivery.DNS_LOOKUPS_PER_TENANT)
        slow = await asyncio.gather(*(d._resolve(f"slow{i}.example", "slowpoke") for i in range(20)),
                                    return_exceptions=True)
        assert all(isinstance(r, TimeoutError) for r in slow)
        assert len(lookups.asked) == delivery.DNS_LOOKUPS_PER_TENANT
        fast = await asyncio.wait_for(d._resolve("fast.example", "acme"), 0.2)
        assert fast("fast.example") == ["93.184.216.34"]
        lookups.release.set()
        d._dns_pool.shutdown(wait=False)

    asyncio.run(scenario())


def test_a_tenants_many_hosts_that_answer_all_resolve(monkeypatch):
    """Given one event fanned out to 12 of a tenant's endpoints on 12 hosts not yet looked up, whose name
    servers answer in 20 ms,
    When the 12 deliveries look their hosts up at once,
    Then all 12 resolve (the ones past DNS_LOOKUPS_PER_TENANT wait a moment for a turn; none fails: a failed
    attempt would count towards degrading its endpoint)."""

    def answers_soon(host: str) -> list[str]:
        time.sleep(0.02)  # the name server's answer time in this scenario
        return ["93.184.216.34"]

    async def scenario() -> None:
        d = _delivery(asyncio.get_running_loop(), threads=32)
        resolved = await asyncio.gather(*(d._resolve(f"host{i}.example", "acme") for i in range(12)))
        assert [r(f"host{i}.example") for i, r in enumerate(resolved)] == [["93.184.216.34"]] * 12
        d._dns_pool.shutdown(wait=False)

    monkeypatch.setattr(delivery, "addresses_of", answers_soon)
    asyncio.run(scenario())
