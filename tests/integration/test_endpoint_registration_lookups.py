"""An endpoint's URL check looks its host up on the API's event loop, not on one of the threads every tenant's
requests share: the real webhook routes and endpoint store (Redis), a real name server on loopback that never
answers the hosts of the registrations, and the API's own thread pool (anyio's, 40 threads)."""

import asyncio
import time
from types import SimpleNamespace

import httpx
from fastapi import FastAPI

from streams.webhooks import lookups
from streams.webhooks.api import webhook_routes
from streams.webhooks.endpoints import EndpointStore
from streams.webhooks.ssrf import UrlPolicy
from tests.nameserver import LoopbackNameServer

REGISTRATIONS = 60  # more than the API's 40 threads


def test_registrations_waiting_on_silent_name_servers_hold_none_of_the_apis_threads(
        redis_client, namespace, monkeypatch):
    """Given 60 registrations at once of URLs on hosts whose name servers never answer,
    When, while they wait, the tenant lists its endpoints (a request served on the API's threads),
    Then the list is answered at once, and each registration is refused 422 "does not resolve" after the
    lookup's timeout (8 s here; before, each check waited on one of the API's 40 threads: the list, and every other
    tenant's requests with it, waited until the lookups gave up)."""
    # Long enough that all 60 start waiting before the first gives up, even on a loaded machine.
    monkeypatch.setattr(lookups, "BLOCKING_TIMEOUT_S", 8.0)
    silent = [f"silent{i}.example" for i in range(REGISTRATIONS)]
    with LoopbackNameServer(silent=set(silent)) as nameserver:
        resolver = lookups.BlockingResolver([nameserver.address])
        store = EndpointStore(redis_client, namespace, None, UrlPolicy(require_https=False), resolver)
        app = FastAPI()
        app.include_router(webhook_routes(SimpleNamespace(endpoints=store, current=lambda ep: ep),  # type: ignore
                                          None, None, lambda: "acme"))  # type: ignore[arg-type]

        async def scenario() -> tuple[list[httpx.Response], float]:
            transport = httpx.ASGITransport(app)
            async with httpx.AsyncClient(transport=transport, base_url="http://api") as api:
                registering = [asyncio.ensure_future(api.post("/v1/endpoints", json={
                    "url": f"http://{host}/hooks", "event_types": ["*"]})) for host in silent]
                deadline = time.monotonic() + 30
                while sum(nameserver.asked[host] > 0 for host in silent) < len(silent):
                    assert time.monotonic() < deadline, "every registration to ask its name server"
                    await asyncio.sleep(0.01)  # until every registration waits for its name server
                asked = time.monotonic()
                listed = await api.get("/v1/endpoints")
                took = time.monotonic() - asked
                assert listed.status_code == 200 and listed.json() == {"endpoints": []}
                assert not any(r.done() for r in registering)
                return await asyncio.gather(*registering), took

        try:
            refused, took = asyncio.run(scenario())
        finally:
            resolver.close()
    assert took < 2.0  # before, the list waited for a thread: until the lookups gave up (8 s)
    assert {r.status_code for r in refused} == {422}
    assert all("does not resolve" in r.text for r in refused)
