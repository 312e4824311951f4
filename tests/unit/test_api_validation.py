"""The ingest API refuses what it cannot carry with a 422 naming where, before anything is published."""

import asyncio
from types import SimpleNamespace

import httpx
import orjson
import pytest

from streams.ingest.api import Ingest, create_app
from streams.ingest.api_keys import Principal
from streams.ingest.senders import SenderDomains
from streams.send import validate_request
from tests.harness import email_request


class OneTenant:
    def resolve(self, token: str) -> Principal:
        return Principal("tenant", "acme", "k1")


def publishing_nothing() -> Ingest:
    """The ingest API's state for one tenant, with a client that fails the test if anything is published."""
    client = SimpleNamespace(names=None, routing=None, records=lambda sends: pytest.fail("nothing may be published"))
    return Ingest(client=client, store=None, keys=OneTenant(), limits=None,  # type: ignore[arg-type]
                  known_policies=frozenset(), senders=SenderDomains())


async def post_to(ingest: Ingest, path: str, **request) -> httpx.Response:
    """One request to the ingest app, in process."""
    transport = httpx.ASGITransport(create_app(ingest), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as api:
        return await api.post(path, **request)


def test_a_payload_nested_too_deep_is_refused_naming_it_never_a_500():
    """Given a send whose payload nests 300 objects deep (the event's JSON encoder stops at 254),
    When it is posted, alone or in a batch,
    Then it is refused 422 naming the payload (before: 500 "may have taken effect", a traceback logged, for a
    request that published nothing); 64 levels are accepted."""
    client = SimpleNamespace(names=None, routing=None, records=lambda sends: pytest.fail("nothing may be published"))
    ingest = Ingest(client=client, store=None, keys=OneTenant(), limits=None,  # type: ignore[arg-type]
                    known_policies=frozenset(), senders=SenderDomains())

    def nested(levels: int) -> dict:
        data: dict = {}
        for _ in range(levels - 1):
            data = {"a": data}
        return data

    async def post(path: str, body: dict) -> httpx.Response:
        transport = httpx.ASGITransport(create_app(ingest), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as api:
            return await api.post(path, json=body, headers={"Authorization": "Bearer dr_ten_x"})

    deep = {**email_request(), "payload": {**email_request()["payload"], "data": nested(300)}}
    one = asyncio.run(post("/v1/sends", deep))
    assert one.status_code == 422 and one.json()["errors"][0]["loc"] == ["body", "payload"], one.text
    assert "nested deeper than 64 levels" in one.text
    batch = asyncio.run(post("/v1/sends/batch", {"sends": [email_request(), deep]}))
    assert batch.status_code == 422 and batch.json()["errors"][0]["loc"] == ["body", "sends", 1, "payload"]
    validate_request({**email_request(), "payload": {**email_request()["payload"], "data": nested(63)}})


@pytest.mark.parametrize("header", ["bearer dr_ten_x", "BEARER dr_ten_x", "Bearer  dr_ten_x "])
def test_the_bearer_scheme_is_read_in_any_case(header):
    """HTTP authentication schemes are case-insensitive (RFC 9110 11.1): `bearer` was answered 401."""
    r = asyncio.run(post_to(publishing_nothing(), "/v1/sends", json={"channel": "email"},
                            headers={"Authorization": header}))
    assert r.status_code == 422  # past authentication, to validation


class CountingGate:
    """The gate's answers for the ingest quotas: every admission allowed, what is given back recorded."""

    def __init__(self):
        self.taken, self.given_back = [], []

    def acquire_many(self, requests):
        from streams.gate.gate import Admission
        self.taken += [(q, t, n) for q, t, n, _ in requests]
        return [Admission(True) for _ in requests]

    def refund_many(self, admitted):
        self.given_back += admitted


def test_a_request_the_broker_refuses_is_charged_to_no_quota():
    """Given a tenant within its quotas, and a broker that refuses the publish (nothing written),
    When it posts a send,
    Then the answer is 503 and what the quotas took is given back (before, every refused request was charged:
    through a broker outage the tenants' quotas drained, and their first requests after it got 429s)."""
    from streams.errors import PublishError
    from streams.ingest.quotas import IngestQuotas

    async def refuse(records):
        raise PublishError("the lane topic refused the record (test)")

    client = SimpleNamespace(names=None, routing=None, records=lambda sends: [object() for _ in sends],
                             publisher=SimpleNamespace(publish_async=refuse))
    gate = CountingGate()
    ingest = Ingest(client=client, store=None, keys=OneTenant(), limits=None,  # type: ignore[arg-type]
                    known_policies=frozenset(), senders=SenderDomains(), quotas=IngestQuotas(gate))

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(create_app(ingest), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as api:
            return await api.post("/v1/sends", json=email_request(), headers={"Authorization": "Bearer dr_ten_x"})

    assert asyncio.run(post()).status_code == 503
    assert gate.taken and sorted(gate.given_back) == sorted(gate.taken)


def test_a_send_is_encoded_once_off_the_event_loop_and_those_bytes_are_published():
    """Given the ingest API, When a send is posted, Then its record is encoded once, on a worker thread, and that
    record is what is published (before: encoded a second time on the event loop, beside every tenant's requests:
    a webhook event copied to 50 endpoints is megabytes)."""
    import threading

    from streams.errors import PublishError

    encoded: list[tuple[str, object]] = []
    published: list = []

    def records(sends):
        out = [object() for _ in sends]
        encoded.append((threading.current_thread().name, out))
        return out

    async def publish_async(records):
        published.append(records)
        raise PublishError("the lane topic refused the record (test)")

    client = SimpleNamespace(names=None, routing=None, records=records,
                             publisher=SimpleNamespace(publish_async=publish_async))
    ingest = Ingest(client=client, store=None, keys=OneTenant(), limits=None,  # type: ignore[arg-type]
                    known_policies=frozenset(), senders=SenderDomains())
    assert asyncio.run(post_to(ingest, "/v1/sends", json=email_request(),
                               headers={"Authorization": "Bearer k"})).status_code == 503
    [(thread, records_made)] = encoded
    assert thread != threading.main_thread().name and published == [records_made]


@pytest.mark.parametrize("value, status, says", [
    ("1180591620717411303424", 422, "an integer outside -2^63 .. 2^64-1"),
    ("NaN", 400, "JSON decode error"),
    ("-Infinity", 400, "JSON decode error"),
])
def test_a_payload_value_the_events_cannot_carry_is_refused_naming_where(value, status, says):
    """Given a batch whose second send's payload holds, under a key that is an address, an integer past 64 bits, NaN
    or an infinity (which the SDK refuses too),
    When it is posted,
    Then it is refused, nothing published: the integer 422 naming the send and the payload path (the address
    redacted), NaN and the infinities 400 as no JSON (never published as null)."""
    send = orjson.dumps(email_request()).decode()
    bad = send.replace('"payload":{', f'"payload":{{"by_recipient":{{"jane@example.test":{value}}},', 1)
    body = f'{{"sends": [{send}, {bad}]}}'.encode()
    from streams.send import encode

    client = SimpleNamespace(names=None, routing=None, records=lambda sends: [encode(s) for s in sends])  # no publisher
    ingest = Ingest(client=client, store=None, keys=OneTenant(), limits=None,  # type: ignore[arg-type]
                    known_policies=frozenset(), senders=SenderDomains())
    answer = asyncio.run(post_to(ingest, "/v1/sends/batch", content=body,
                                 headers={"Authorization": "Bearer k", "Content-Type": "application/json"}))
    assert answer.status_code == status and says in answer.text, answer.text
    assert "jane@example.test" not in answer.text
    if status == 422:
        [error] = answer.json()["errors"]
        assert error["loc"][:5] == ["body", "sends", 1, "payload", "by_recipient"], error


def test_a_body_nested_too_deep_for_the_parser_is_refused_naming_the_body():
    """Given a send whose ignored field nests 5,000 arrays deep (past what the framework's JSON parser reads),
    When it is posted,
    Then it is refused 400 `invalid_request` naming the body and saying why (before: `http_error` with no place
    and "There was an error parsing the body")."""
    body = '{"channel": "email", "junk": ' + "[" * 5000 + "]" * 5000 + "}"
    r = asyncio.run(post_to(publishing_nothing(), "/v1/sends", content=body,
                            headers={"Authorization": "Bearer dr_ten_x", "Content-Type": "application/json"}))
    assert r.status_code == 400 and r.json()["error"] == "invalid_request", r.text
    assert r.json()["errors"][0]["loc"] == ["body"] and "could not be read as JSON" in r.text


class KnownKeys:
    def resolve(self, token: str) -> Principal | None:
        return Principal("tenant", "acme", "k1") if token == "dr_ten_x" else None


@pytest.mark.parametrize("body", ['{"channel": "email", ', '{"junk": ' + "[" * 5000 + "]" * 5000 + "}"])
def test_a_body_that_is_not_json_is_answered_401_to_a_caller_without_a_valid_key(body):
    """Given a body the API cannot parse (broken JSON, or nested past what the framework's parser reads),
    When it is posted without a key, with a key nobody issued, and with a valid key,
    Then the first two get 401 `unauthorized` and only the last is told about its body (400): the framework
    parses a body before authentication runs, so before, anybody learnt about their JSON without a key."""
    ingest = publishing_nothing()
    ingest.keys = KnownKeys()  # type: ignore[assignment]
    answers = [asyncio.run(post_to(ingest, "/v1/sends", content=body, headers={
        "Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}))
        for key in (None, "dr_nobody", "dr_ten_x")]
    assert [(r.status_code, r.json()["error"]) for r in answers] == [
        (401, "unauthorized"), (401, "unauthorized"), (400, "invalid_request")], [r.text for r in answers]


def _rejected(status: int) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("dispatch_ingest_rejected_total", {"status": str(status)}) or 0.0


def test_bodies_refused_before_the_app_reads_them_are_counted_as_refusals():
    """Given the ingest API,
    When a body over the size limit (413) and a body holding an unpaired surrogate, which no event can carry
    (400), are posted (both answered before the app sees them),
    Then each is counted in dispatch_ingest_rejected_total under its status, as every other refusal is (before:
    neither was, so the dashboard and alerts missed them)."""
    ingest = publishing_nothing()
    before = _rejected(413), _rejected(400)
    too_big = asyncio.run(post_to(ingest, "/v1/sends", content=b"x" * (6 * 1024 * 1024),
                                  headers={"Authorization": "Bearer k", "Content-Type": "application/json"}))
    surrogate = asyncio.run(post_to(ingest, "/v1/sends", content=b'{"channel": "\\ud800"}',
                                    headers={"Authorization": "Bearer k", "Content-Type": "application/json"}))
    assert (too_big.status_code, surrogate.status_code) == (413, 400)
    assert (_rejected(413), _rejected(400)) == (before[0] + 1, before[1] + 1)


@pytest.mark.parametrize("raw, says", [
    (b"\xff", "the body is not UTF-8: byte 0xff at offset "),
    (b"\xed\xa0\x80", "the body is not UTF-8: byte 0xed at offset "),  # an encoded surrogate
])
def test_a_body_that_is_not_utf8_is_refused_saying_where(raw, says):
    """Given a batch whose second send's subject holds a byte that is not UTF-8, or an encoded surrogate,
    When it is posted,
    Then it is refused 400 naming the byte and its offset in the body (before: "could not be read as JSON (nested
    too deeply for the parser?)", or orjson's "line 1 column 1 (char 0)": neither said what nor where)."""
    first = b'{"sends": [{"channel": "email"}, {"payload": {"subject": "'
    body = first + raw + b'"}}]}'
    answer = asyncio.run(post_to(publishing_nothing(), "/v1/sends/batch", content=body,
                                 headers={"Authorization": "Bearer k", "Content-Type": "application/json"}))
    assert answer.status_code == 400, answer.text
    assert answer.json()["errors"] == [{"loc": ["body"], "msg": answer.json()["errors"][0]["msg"]}]
    assert answer.json()["errors"][0]["msg"].startswith(f"{says}{len(first)} ")


def test_a_body_that_is_not_json_is_refused_saying_what_the_parser_met_and_where():
    """Given a send whose JSON breaks off after a comma,
    When it is posted,
    Then the 400 says what the parser met as well as where (before: "JSON decode error" and an offset alone)."""
    answer = asyncio.run(post_to(publishing_nothing(), "/v1/sends", content=b'{"channel": "email",}',
                                 headers={"Authorization": "Bearer k", "Content-Type": "application/json"}))
    assert answer.status_code == 400, answer.text
    [error] = answer.json()["errors"]
    assert error["loc"] == ["body", 20] and error["msg"].startswith("JSON decode error: "), error
    assert len(error["msg"]) > len("JSON decode error: ")
