"""A request with a body is refused for its API key before its body is read: a sender without a key costs the API
process no memory and no parsing, beside every tenant's single sends."""

import asyncio
from types import SimpleNamespace

import httpx
import orjson
import pytest

from streams.errors import StoreUnavailable
from streams.ingest.api import Ingest, create_app
from streams.ingest.api_keys import Principal
from streams.ingest.senders import SenderDomains
from tests.harness import email_request

TENANT_KEY = "dr_ten_acme"


class Keys:
    """One tenant key; "redis-down" cannot be checked. Counts the lookups (each is a Redis round trip)."""

    def __init__(self):
        self.lookups = 0

    def resolve(self, token: str) -> Principal | None:
        self.lookups += 1
        if token == "redis-down":
            raise StoreUnavailable("Redis did not answer")
        return Principal("tenant", "acme", "k1") if token == TENANT_KEY else None


def app_with(keys: Keys):
    client = SimpleNamespace(names=None, routing=None, records=lambda sends: pytest.fail("nothing may be published"))
    return create_app(Ingest(client=client, store=None, keys=keys, limits=None,  # type: ignore[arg-type]
                             known_policies=frozenset(), senders=SenderDomains()))


def call_unread(app, method: str, path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, dict]:
    """Call the app as the server would, with a body whose reading fails the test; the answer's status and body."""
    answer: dict = {"body": b""}

    async def receive():
        pytest.fail("the body was read before the API key was checked")

    async def send(message):
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
        else:
            answer["body"] += message.get("body", b"")

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http",
             "server": ("api", 80), "client": ("127.0.0.1", 5000),
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"5000000"), *headers]}
    asyncio.run(app(scope, receive, send))
    return answer["status"], orjson.loads(answer["body"])


@pytest.mark.parametrize("method, path", [("POST", "/v1/sends"), ("POST", "/v1/sends/batch"),
                                          ("PUT", "/v1/admin/limits/resend"), ("PATCH", "/v1/endpoints/ep_1")])
@pytest.mark.parametrize("authorization", [None, b"Bearer made-up", b"Basic dXNlcjpwdw=="])
def test_a_request_without_a_valid_key_is_refused_before_its_body_is_read(method, path, authorization):
    """Given the ingest API,
    When a POST, PUT or PATCH comes with no key, a key nobody issued, or no bearer token, announcing a 5 MB body,
    Then it is answered 401 (unauthorized, naming the Authorization header) without a byte of its body read (before:
    the body was read whole, up to 5 MiB, and parsed as JSON, and a body that was not UTF-8 was answered 400, before
    the key was looked at)."""
    status, body = call_unread(app_with(Keys()), method, path,
                               [(b"authorization", authorization)] if authorization else [])
    assert status == 401
    assert body == {"error": "unauthorized", "errors": [{"loc": ["header", "authorization"],
                                                         "msg": "a valid API key is required (Bearer)"}]}


async def _post(app, path: str, token: str, body: bytes, **headers) -> httpx.Response:
    transport = httpx.ASGITransport(app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as api:
        return await api.post(path, content=body, headers={"Authorization": f"Bearer {token}",
                                                           "Content-Type": "application/json", **headers})


def test_a_valid_key_lets_the_body_be_read_and_is_checked_again_once_it_is_in():
    """Given a tenant's valid key,
    When it posts a body that is not UTF-8, and then a valid send during which its key is revoked (after the check
    ahead of the body, before the route's),
    Then the first body is read and refused 400 naming the byte (the key was good); the second is refused 401 by the
    route and nothing is published (a key revoked while a slow body arrived does not publish it)."""
    keys = Keys()
    answer = asyncio.run(_post(app_with(keys), "/v1/sends", TENANT_KEY, b'{"channel": "\xff"}'))
    assert answer.status_code == 400 and "not UTF-8" in answer.text, answer.text

    class RevokedMeanwhile(Keys):
        def resolve(self, token):
            found = super().resolve(token)
            return found if self.lookups == 1 else None

    revoked = RevokedMeanwhile()
    answer = asyncio.run(_post(app_with(revoked), "/v1/sends", TENANT_KEY, orjson.dumps(email_request())))
    assert answer.status_code == 401 and revoked.lookups == 2, answer.text


def test_a_key_lookup_failing_unexpectedly_is_answered_by_the_route_in_the_one_error_shape():
    """Given a key lookup that fails as nobody expected (a key record Redis holds that cannot be read),
    When a send is posted, Then the answer is the API's own 500 (`internal_error`, the outcome unknown), not the
    server's plain-text error from outside the app."""

    class Broken(Keys):
        def resolve(self, token):
            raise KeyError("role")

    answer = asyncio.run(_post(app_with(Broken()), "/v1/sends", TENANT_KEY, orjson.dumps(email_request())))
    assert answer.status_code == 500 and answer.json()["error"] == "internal_error", answer.text


def test_a_key_that_cannot_be_checked_is_answered_by_the_route_as_before():
    """Given Redis not answering the key's lookup, When a keyed send is posted, Then the route answers it: 503, the
    outcome unknown (an earlier attempt under that Idempotency-Key may have been published), never a 401."""
    answer = asyncio.run(_post(app_with(Keys()), "/v1/sends", "redis-down", b"{}", **{"Idempotency-Key": "k-1"}))
    assert answer.status_code == 503 and answer.json().get("outcome") == "unknown", answer.text
