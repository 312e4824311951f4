"""While Redis has lost its data and `streams state recover` has not finished, a status the API cannot find is
answered 503 (ask again), not 404 "no such send": clients would take the send for one that never existed."""

import asyncio
from types import SimpleNamespace

import httpx

from streams.errors import StateLost
from streams.ingest.api import Ingest, create_app
from streams.ingest.api_keys import Principal


class OneTenant:
    def resolve(self, token: str) -> Principal:
        return Principal("tenant", "acme", "k1")


class EmptiedStore:
    """A status store that finds nothing; `lost`: because Redis lost its data (no epoch), not yet recovered."""

    def __init__(self, lost: bool):
        self.lost = lost

    def get(self, send_id):
        return None

    def require_data(self):
        if self.lost:
            raise StateLost("Redis has lost its data and `streams state recover` has not finished")


def _get(store: EmptiedStore, path: str) -> httpx.Response:
    ingest = Ingest(client=SimpleNamespace(names=None, routing=None), store=store, keys=OneTenant(),  # type: ignore[arg-type]
                    limits=None, known_policies=frozenset())  # type: ignore[arg-type]
    transport = httpx.ASGITransport(create_app(ingest), raise_app_exceptions=False)

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as api:
            return await api.get(path, headers={"Authorization": "Bearer dr_ten_x"})

    return asyncio.run(call())


def test_a_status_missing_because_redis_lost_its_data_is_a_503_not_a_404():
    """Given Redis emptied (its data lost) and not yet recovered, then holding its data,
    When a tenant asks for a send's status that is not there,
    Then the answer is 503 with Retry-After while the data is lost (before: 404 "no such send for this tenant", and a
    client could submit the send again), and 404 once Redis holds its data."""
    lost = _get(EmptiedStore(lost=True), "/v1/sends/s-1")
    assert lost.status_code == 503 and "Retry-After" in lost.headers, lost.text
    assert _get(EmptiedStore(lost=False), "/v1/sends/s-1").status_code == 404


def test_webhook_deliveries_missing_because_redis_lost_its_data_are_a_503_not_404_or_an_empty_list():
    """Given Redis emptied and not yet recovered, and an endpoint of acme's (kept in the endpoint view, not Redis),
    When acme asks for a delivery, for the endpoint's deliveries, or to replay the endpoint's range,
    Then each is answered 503 (before: 404, an empty list, and a bulk replay of nothing at all, 202), and once Redis
    holds its data: 404, an empty list, and 202 with nothing replayed."""
    from fastapi import FastAPI

    from streams.webhooks.api import webhook_routes
    from streams.webhooks.model import Endpoint

    endpoint = Endpoint(id="ep_1", tenant="acme", url="https://hooks.example/x", event_types=("*",))
    hooks = SimpleNamespace(endpoints=SimpleNamespace(get=lambda tenant, endpoint_id: endpoint), current=lambda ep: ep)

    def answers(lost: bool) -> list[int | str]:
        store = EmptiedStore(lost)
        store.endpoint_deliveries = lambda *args, **kwargs: []  # type: ignore[attr-defined]
        store.endpoint_deliveries_between = lambda *args, **kwargs: []  # type: ignore[attr-defined]
        app = FastAPI()  # without the API's handlers: StateLost comes out as it is (the API answers it 503)
        app.include_router(webhook_routes(hooks, store, SimpleNamespace(), lambda: "acme"))  # type: ignore[arg-type]
        transport = httpx.ASGITransport(app, raise_app_exceptions=True)

        async def call(method: str, path: str, **request) -> int | str:
            async with httpx.AsyncClient(transport=transport, base_url="http://api") as api:
                try:
                    return (await api.request(method, path, **request)).status_code
                except StateLost:
                    return "StateLost"

        return [asyncio.run(call("GET", "/v1/deliveries/d-1")),
                asyncio.run(call("GET", "/v1/endpoints/ep_1/deliveries")),
                asyncio.run(call("POST", "/v1/endpoints/ep_1/replay", json={"since_ms": 0}))]

    assert answers(lost=True) == ["StateLost"] * 3
    assert answers(lost=False) == [404, 200, 202]
