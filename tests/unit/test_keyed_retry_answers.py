"""A keyed request that published nothing itself, under an Idempotency-Key an earlier attempt may have published
under, is answered `"outcome": "unknown"`: a plain 503 says "not published", and a client believing it would
send the request again under a new key, a second copy."""

import asyncio
from types import SimpleNamespace

import httpx
import orjson
import pytest

from streams.errors import PublishError, StackError, StoreUnavailable
from streams.ingest.api import Ingest, create_app
from streams.ingest.api_keys import Principal
from streams.ingest.idempotency import Claimed
from streams.ingest.publisher import Written
from streams.ingest.sdk import SendClient
from streams.ingest.web import Auth
from streams.names import TopicNames
from tests.harness import email_request


class Keys:
    down = False  # the state store failing when a key is checked

    def resolve(self, token: str):
        if self.down:
            raise StoreUnavailable("Redis down (test)")
        return Principal("tenant", "acme", "key-1")

    def touch(self, *args, **kwargs):
        pass


class Idempotency:
    """A key taken over from an earlier attempt (`maybe_published_before`), or claimed for the first time."""

    def __init__(self, taken_over: bool):
        self.taken_over = taken_over
        self.ended: list[str] = []

    def begin(self, tenant, key, digest, route):
        if self.taken_over is None:
            raise StoreUnavailable("checking an Idempotency-Key: Redis unavailable (test)")
        return Claimed(1_700_000_000_000, "holder-1", maybe_published_before=self.taken_over)

    def release(self, tenant, key, holder):
        self.ended.append("release")

    def lapse(self, tenant, key, holder):
        self.ended.append("lapse")

    def renew(self, tenant, key, holder):
        return True


class Refusing:
    """A broker that refuses every publish whole (nothing written), or a state store that fails."""

    def __init__(self, exc: Exception):
        self.exc = exc

    async def publish_async(self, records):
        raise self.exc


def _post(taken_over: bool | None, exc: Exception) -> tuple[httpx.Response, Idempotency]:
    client = SendClient("127.0.0.1:1", TopicNames("t."))
    client.publisher.close()
    client.publisher = Refusing(exc)  # type: ignore[assignment]
    idempotency = Idempotency(taken_over)
    ingest = Ingest(client=client, store=SimpleNamespace(), keys=Keys(), limits=None,  # type: ignore[arg-type]
                    known_policies=frozenset(), idempotency=idempotency)  # type: ignore[arg-type]
    transport = httpx.ASGITransport(create_app(ingest), raise_app_exceptions=False)

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as http:
            return await http.post("/v1/sends", json=email_request(), headers={
                "Authorization": "Bearer dr_ten_x", "Idempotency-Key": "order-7"})

    return asyncio.run(call()), idempotency


@pytest.mark.parametrize("exc", [PublishError("refused whole (test)"), StoreUnavailable("Redis down (test)")])
def test_a_retry_of_a_maybe_published_request_that_publishes_nothing_says_the_outcome_is_unknown(exc):
    """Given a key whose earlier attempt's outcome was unknown (the broker may hold it), taken over by a retry,
    When that retry is refused whole (the broker refuses it, or the state store fails), publishing nothing,
    Then the answer is 503 `"outcome": "unknown"` saying an earlier attempt may have been published and to retry
    with the same key, and the key keeps its first use (before: a plain 503, which says nothing was published)."""
    r, idempotency = _post(taken_over=True, exc=exc)
    assert r.status_code == 503, r.text
    assert r.json()["outcome"] == "unknown"
    assert "an earlier attempt under this Idempotency-Key may have been published" in r.text
    assert "same Idempotency-Key" in r.text and "Redis" not in r.text
    assert idempotency.ended == ["release"]  # the store's release keeps a maybe-published key (it lapses it)


@pytest.mark.parametrize("route, body", [("/v1/sends", email_request()), ("/v1/sends/batch", {"sends": [email_request()]})])
def test_a_keyed_send_whose_api_key_cannot_be_checked_says_the_outcome_is_unknown(route, body):
    """Given a state store failing when the caller's API key is checked (before the Idempotency-Key is),
    When a send (or a batch) under a key is made, a retry perhaps of an attempt whose outcome was unknown,
    Then 503 `"outcome": "unknown"` saying to retry with the same key (before: a plain 503, "nothing was
    changed", and a client trusting it sent again under a new key); without a key, a plain 503."""
    keys = Keys()
    keys.down = True
    ingest = Ingest(client=SendClient("127.0.0.1:1", TopicNames("t.")), store=SimpleNamespace(), keys=keys,  # type: ignore[arg-type]
                    limits=None, known_policies=frozenset(), idempotency=Idempotency(None))  # type: ignore[arg-type]
    transport = httpx.ASGITransport(create_app(ingest), raise_app_exceptions=False)

    async def call(headers: dict) -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as http:
            return await http.post(route, json=body, headers={"Authorization": "Bearer dr_ten_x", **headers})

    keyed = asyncio.run(call({"Idempotency-Key": "order-7"}))
    assert keyed.status_code == 503 and keyed.json()["outcome"] == "unknown", keyed.text
    assert "same Idempotency-Key" in keyed.text and "Redis" not in keyed.text
    plain = asyncio.run(call({}))
    assert plain.status_code == 503 and "outcome" not in plain.json(), plain.text
    ingest.client.publisher.close()


@pytest.mark.parametrize("exc", [PublishError("refused whole (test)"), StoreUnavailable("Redis down (test)")])
def test_a_first_attempt_refused_whole_says_nothing_was_published(exc):
    """Given a key used for the first time, When the broker refuses the request whole (or the state store fails
    before it is published), Then a plain 503: nothing was published, and the key is free again."""
    r, idempotency = _post(taken_over=False, exc=exc)
    assert r.status_code == 503 and "outcome" not in r.json(), r.text
    assert idempotency.ended == ["release"]


def test_a_keyed_request_whose_key_cannot_be_checked_says_the_outcome_is_unknown():
    """Given a state store that fails when the request's Idempotency-Key is checked (so whether an earlier attempt
    under it was published cannot be told), When the request is made, Then 503 `"outcome": "unknown"` naming the
    state store and saying to retry with the same key (before: a plain 503, "not published")."""
    r, idempotency = _post(taken_over=None, exc=PublishError("never reached (test)"))
    assert r.status_code == 503 and r.json()["outcome"] == "unknown", r.text
    assert "state store is unavailable" in r.text and "same Idempotency-Key" in r.text
    assert idempotency.ended == []



@pytest.mark.parametrize("taken_over", [True, False])
def test_a_retry_refused_now_says_whether_an_earlier_attempt_may_have_been_published(taken_over):
    """Given a request under a key whose earlier attempt's outcome was unknown (taken over), or a first use,
    When it is refused now for what it holds (here: a retry policy no longer defined, 422),
    Then the retry's refusal carries `"outcome": "unknown"` and says an earlier attempt under the key may have been
    published (before: a plain 422, which reads as final, and the client dropped a request that may be
    delivered); a first use's refusal says nothing of the kind."""
    client = SendClient("127.0.0.1:1", TopicNames("t."))
    client.publisher.close()
    client.publisher = Refusing(PublishError("never reached (test)"))  # type: ignore[assignment]
    ingest = Ingest(client=client, store=SimpleNamespace(), keys=Keys(), limits=None,  # type: ignore[arg-type]
                    known_policies=frozenset({"default"}), idempotency=Idempotency(taken_over))  # type: ignore[arg-type]
    transport = httpx.ASGITransport(create_app(ingest), raise_app_exceptions=False)

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as http:
            return await http.post("/v1/sends", json={**email_request(), "policy": "removed"}, headers={
                "Authorization": "Bearer dr_ten_x", "Idempotency-Key": "order-7"})

    r = asyncio.run(call())
    assert r.status_code == 422, r.text
    if taken_over:
        assert r.json()["outcome"] == "unknown"
        assert r.json()["errors"][0]["loc"] == ["body", "policy"]
        assert "an earlier attempt under this Idempotency-Key may have been published" in r.text
    else:
        assert "outcome" not in r.json() and "earlier attempt" not in r.text


class Acknowledging:
    """A broker that acknowledges every publish, and keeps what was published without waiting."""

    def __init__(self):
        self.unwaited: list = []

    async def publish_async(self, records):
        return [Written(r.topic, 0, i) for i, r in enumerate(records)]

    def publish_unwaited(self, records):
        self.unwaited += records


class StatusesDown:
    def accepted(self, sends):
        raise StoreUnavailable("recording statuses: Redis unavailable (test)")


def test_a_send_published_whose_status_cannot_be_written_gets_it_through_the_outcomes_topic():
    """Given a broker that acknowledges a send, and a state store that then fails to record its `accepted` status
    (Redis gone for a moment, a Redis Cluster master failing over),
    When the send is posted,
    Then it is answered 202 and its `accepted` event goes to notif.outcomes, from which the outcome recorder writes
    the status (before: nothing did, and the send read as unknown until its first outcome)."""
    client = SendClient("127.0.0.1:1", TopicNames("t."))
    client.publisher.close()
    broker = Acknowledging()
    client.publisher = broker  # type: ignore[assignment]
    ingest = Ingest(client=client, store=StatusesDown(), keys=Keys(), limits=None,  # type: ignore[arg-type]
                    known_policies=frozenset(), idempotency=None)
    transport = httpx.ASGITransport(create_app(ingest), raise_app_exceptions=False)

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as http:
            return await http.post("/v1/sends", json=email_request(), headers={"Authorization": "Bearer dr_ten_x"})

    r = asyncio.run(call())
    assert r.status_code == 202, r.text
    [record] = broker.unwaited
    [event] = orjson.loads(record.value)["events"]
    assert record.topic == "t.notif.outcomes" and record.key == r.json()["send_id"].encode()
    assert (event["send_id"], event["status"], event["channel"], event["lane"]) == (
        r.json()["send_id"], "accepted", "email", "transactional")


class LogUnreadable:
    """A state guard whose operator log cannot be read: every check raises (as one that could not finish does until
    one finishes)."""

    def check(self) -> bool:
        raise StackError("reading the operator log stalled at offset 7")


def test_an_unreadable_operator_log_is_logged_once_a_while_not_at_every_request(caplog):
    """Given a guard raising at every request while the operator log cannot be read (keys in Redis still work),
    When 50 requests are authenticated, Then each is (the key resolved) and one warning is logged, not 50."""
    from starlette.requests import Request

    auth = Auth(Keys(), LogUnreadable())  # type: ignore[arg-type]
    request = Request({"type": "http", "headers": [(b"authorization", b"Bearer dr_ten_x")]})
    with caplog.at_level("WARNING", logger="streams"):
        principals = [auth.principal(request) for _ in range(50)]
    assert all(p.tenant == "acme" for p in principals)
    assert len([r for r in caplog.records if "operator log" in r.getMessage()]) == 1
