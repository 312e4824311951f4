"""A failure nobody expected is answered like every other error: 500 in the one error shape, with
`outcome: unknown`, never the failure's own text; and the OpenAPI says every route can answer it."""

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from streams.ingest.api import Ingest, create_app
from streams.ingest.web import ErrorBody


class BrokenKeys:
    """An API key store with a bug in it (the app's own code, not a dependency being down)."""

    def resolve(self, token: str):
        raise KeyError("redis-internal-7.corp:6379 tenant-b")


class InProcess:
    """The app called in this process (no server): what the server would answer."""

    def __init__(self, app):
        self.transport = httpx.ASGITransport(app, raise_app_exceptions=False)

    def get(self, path: str, **kwargs) -> httpx.Response:
        async def call() -> httpx.Response:
            async with httpx.AsyncClient(transport=self.transport, base_url="http://api") as client:
                return await client.get(path, **kwargs)

        return asyncio.run(call())


@pytest.fixture
def api():
    ingest = Ingest(client=SimpleNamespace(names=None, routing=None), store=None, keys=BrokenKeys(),  # type: ignore[arg-type]
                    limits=None, known_policies=frozenset())  # type: ignore[arg-type]
    return InProcess(create_app(ingest))


def test_an_unexpected_failure_is_answered_in_the_error_shape_and_keeps_its_text_to_itself(api):
    """Given an API whose key lookup fails with a bug,
    When a tenant asks for a send's status,
    Then the answer is 500 JSON in the documented shape, `outcome: unknown`, naming the route but neither
    the internal host nor the tenant the failure's own text holds."""
    r = api.get("/v1/sends/some-id", headers={"Authorization": "Bearer dr_ten_x"})
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    body = ErrorBody.model_validate(r.json())
    assert body.error == "internal_error" and body.outcome == "unknown"
    assert "GET /v1/sends/some-id failed unexpectedly" in body.errors[0].msg
    assert "redis-internal" not in r.text and "tenant-b" not in r.text


def test_the_openapi_documents_500_on_every_route(api):
    schema = api.get("/openapi.json").json()
    for path, methods in schema["paths"].items():
        for method, operation in methods.items():
            assert operation["responses"]["500"]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/ErrorBody"}, (method, path)
