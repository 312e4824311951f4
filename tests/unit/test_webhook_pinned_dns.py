"""The webhook client connects only to addresses the URL policy approved (no second DNS lookup)."""

import asyncio

import aiohttp
import pytest
from aiohttp import web

from streams.webhooks.delivery import PinnedResolver
from streams.webhooks.ssrf import wire_host


async def _hits_at(approved: dict[str, list[str]], url: str) -> int:
    resolver = PinnedResolver()
    for host, addresses in approved.items():
        resolver.approve(host, addresses)
    connector = aiohttp.TCPConnector(resolver=resolver, use_dns_cache=False)
    async with aiohttp.ClientSession(connector=connector) as session, session.get(url) as resp:
        return resp.status


def test_a_host_connects_to_its_approved_address_and_an_unchecked_host_nowhere():
    """Given a receiver on 127.0.0.1 and a resolver that approved `hook.test` -> 127.0.0.1 only,
    When the client calls http://hook.test and http://rebind.test (a name nobody checked) on that port,
    Then the first reaches the receiver (the approved address, no system DNS asked) and the second is never
    connected: the host does not resolve."""

    async def scenario() -> None:
        hits: list[str] = []

        async def receive(request: web.Request) -> web.Response:
            hits.append(request.host)
            return web.Response(status=204)

        app = web.Application()
        app.router.add_get("/", receive)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            assert await _hits_at({"hook.test": ["127.0.0.1"]}, f"http://hook.test:{port}/") == 204
            with pytest.raises(aiohttp.ClientConnectorError) as refused:
                await _hits_at({"hook.test": ["127.0.0.1"]}, f"http://rebind.test:{port}/")
            assert "no address approved" in str(refused.value.os_error)
            assert hits == [f"hook.test:{port}"]
        finally:
            await runner.cleanup()

    asyncio.run(scenario())


def test_an_internationalised_host_is_approved_under_the_name_the_client_looks_up():
    """Given a URL policy that approved https://faß.example/ -> 127.0.0.1 (under its `wire_host`),
    When the HTTP client asks for the host in its IDNA 2008 ASCII form (as aiohttp does),
    Then it gets the approved address (and not a DNS failure that would degrade the endpoint)."""
    resolver = PinnedResolver()
    resolver.approve(wire_host("https://faß.example/hooks"), ["127.0.0.1"])

    [answer] = asyncio.run(resolver.resolve("xn--fa-hia.example", 443))

    assert answer["host"] == "127.0.0.1" and answer["port"] == 443


def test_hosts_approved_long_ago_are_not_kept(monkeypatch):
    """Given a worker that approved 3,000 hosts (a tenant sending to new names under its wildcard DNS), then, past
    how long an approval is kept, 1,200 others,
    When the approved hosts are counted,
    Then only the 1,200 are kept (before: every host ever approved, for as long as the worker ran), and each
    still resolves to its addresses."""
    from streams.webhooks import delivery

    clock = [1000.0]
    monkeypatch.setattr(delivery.time, "monotonic", lambda: clock[0])
    resolver = PinnedResolver()
    for i in range(3000):
        resolver.approve(f"r{i}.tenant.test", ["192.0.2.1"])
    clock[0] += delivery.APPROVAL_KEPT_S + 1
    for i in range(3000, 4200):
        resolver.approve(f"r{i}.tenant.test", ["192.0.2.2"])
    assert set(resolver.approved) == {f"r{i}.tenant.test" for i in range(3000, 4200)}
    [answer] = asyncio.run(resolver.resolve("r4199.tenant.test", 443))
    assert answer["host"] == "192.0.2.2"
