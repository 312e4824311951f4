"""The API's bulk process: its supervisor keeps starting it when a start itself fails, and the API bounds the
batches it forwards to it at once."""

import asyncio
import errno
import subprocess
import sys

import pytest

from streams.errors import PublishError, StoreUnavailable
from streams.ingest import bulk
from streams.ingest.api_keys import Principal
from streams.ingest.unix_http import Answer
from tests.harness import wait_until


def test_a_bulk_process_that_cannot_be_started_is_started_again_later(monkeypatch, caplog):
    """Given a host out of processes for a moment (the first start fails with EAGAIN at the pod's pid limit),
    When the API's supervisor starts the bulk process,
    Then it says so and starts it again after its back-off (before: the error ended the supervising thread, and
    every batch got 503 for the API process's whole life, with no restart counted for the alert)."""
    started: list[subprocess.Popen] = []
    asked: list[list[str]] = []

    def start(argv, nice):
        asked.append(argv)
        if len(asked) == 1:
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        return started[-1]

    monkeypatch.setattr(bulk, "start_in_own_session", start)
    process = bulk.BulkProcess(nice=0)
    process.start()
    try:
        wait_until(lambda: started, 10, "the bulk process started after the failed start")
        assert "the bulk ingest process could not be started ([Errno 11] Resource temporarily unavailable)" \
            in caplog.text
    finally:
        process.stop()
    assert started[0].poll() is not None  # stopped with the API


class HeldBulk:
    """A bulk process that answers each batch only once `answer` is set (a slow broker)."""

    def __init__(self):
        self.answer = asyncio.Event()
        self.forwarded = 0

    async def request(self, method, target, headers, body, timeout_s):
        self.forwarded += 1
        await self.answer.wait()
        return Answer(202, [(b"content-type", b"application/json")], b'{"accepted": 1}')


KEYS = {"key-a": Principal("tenant", "tenant-a", "ka"), "key-a2": Principal("tenant", "tenant-a", "ka2"),
        "key-b": Principal("tenant", "tenant-b", "kb"), "key-c": Principal("tenant", "tenant-c", "kc"),
        "key-d": Principal("tenant", "tenant-d", "kd"), "key-op": Principal("operator", None, "ko")}


def test_batches_forwarded_at_once_are_bounded_per_tenant_and_in_all(monkeypatch):
    """Given a bulk process slow to answer (a slow broker),
    When one tenant posts more batches at once than FORWARDS_PER_TENANT, and others fill FORWARDS_MAX,
    Then the tenant's extra batch is answered 429 at once, whichever of its keys it comes with (before: counted by
    key, so a tenant with a few keys took every place, its batches waiting in the bulk process for their turn one at
    a time, and every other tenant's batch was refused), its key written otherwise too (the scheme in another case,
    spaces around the token), or followed by a made-up key in a second Authorization header, which the API does not
    read (`"outcome": "unknown"` for a keyed batch: it may retry an attempt whose outcome was unknown); a made-up key
    is 401 and an operator's 403, at once and forwarded nowhere (before: each took a place, its body read by the
    bulk process before its 401); past FORWARDS_MAX any batch is answered 503 (before any bound: every batch was
    held, body and all, until the bulk process answered); once answered, the tenant may post again."""
    import httpx

    monkeypatch.setattr(bulk, "FORWARDS_MAX", bulk.FORWARDS_PER_TENANT + 2)
    proxy = bulk.BulkProxy(lambda scope, receive, send: None, None, KEYS.get)
    proxy.bulk = held = HeldBulk()

    async def scenario():
        transport = httpx.ASGITransport(app=proxy)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            def post(key, **headers):
                return asyncio.create_task(client.post(bulk.BATCH_PATH, content=b'{"sends": []}',
                                                       headers={"authorization": f"Bearer {key}", **headers}))

            first = [post("key-a") for _ in range(bulk.FORWARDS_PER_TENANT)]
            while held.forwarded < bulk.FORWARDS_PER_TENANT:
                await asyncio.sleep(0)
            other_key = await post("key-a2")  # another key of the same tenant: the same count
            extra = await asyncio.create_task(client.post(  # the same key, written otherwise: the same count
                bulk.BATCH_PATH, content=b'{"sends": []}', headers={"authorization": "bearer   key-a "}))
            # A second Authorization header after the key: the API authenticates the first, so it is counted so
            smuggled = await asyncio.wait_for(client.post(bulk.BATCH_PATH, content=b'{"sends": []}', headers=[
                ("authorization", "Bearer key-a"), ("authorization", "Bearer made-up")]), 10)  # held: forwarded
            keyed = await post("key-a", **{"idempotency-key": "k-1"})
            made_up, operator, none = await post("made-up"), await post("key-op"), await asyncio.create_task(
                client.post(bulk.BATCH_PATH, content=b'{"sends": []}'))
            others = [post("key-b") for _ in range(2)]
            while held.forwarded < bulk.FORWARDS_PER_TENANT + 2:
                await asyncio.sleep(0)
            full = await post("key-c")
            full_keyed = await post("key-d", **{"idempotency-key": "k-2"})
            forwarded = held.forwarded
            held.answer.set()
            answered = [r.status_code for r in await asyncio.gather(*first, *others)]
            again = await post("key-a2")
        return other_key, extra, smuggled, keyed, made_up, operator, none, full, full_keyed, forwarded, answered, again

    other_key, extra, smuggled, keyed, made_up, operator, none, full, full_keyed, forwarded, answered, again = (
        asyncio.run(scenario()))
    for refused in (other_key, extra, smuggled):
        assert refused.status_code == 429 and refused.json()["error"] == "too_many_batches", refused.text
    assert extra.headers["retry-after"] == "1" and "key-a" not in extra.text and "tenant-a" not in extra.text
    assert (made_up.status_code, none.status_code, operator.status_code) == (401, 401, 403), (made_up.text,
                                                                                             operator.text)
    assert made_up.json() == {"error": "unauthorized", "errors": [{"loc": ["header", "authorization"],
                                                                   "msg": "a valid API key is required (Bearer)"}]}
    assert forwarded == bulk.FORWARDS_PER_TENANT + 2  # none of the refused reached the bulk process
    assert full.status_code == 503 and "nothing was published" in full.text
    assert "outcome" not in extra.json() and "outcome" not in full.json()
    # A keyed batch may be the retry of an attempt left unknown: never told "not sent" (sent again under a new key)
    for refused, status in ((keyed, 429), (full_keyed, 503)):
        assert refused.status_code == status and refused.json()["outcome"] == "unknown", refused.text
        assert "an earlier attempt under this Idempotency-Key may have been" in refused.text
    assert answered == [202] * (bulk.FORWARDS_PER_TENANT + 2) and again.status_code == 202
    assert proxy._forwarding == {}


@pytest.mark.parametrize("failure", [StoreUnavailable("checking the API key: Redis unavailable (test)"),
                                     PublishError("the operator log did not acknowledge an epoch marker (test)")])
def test_a_batch_whose_key_cannot_be_checked_is_answered_503_and_neither_forwarded_nor_published(failure):
    """Given a key that cannot be checked (Redis down, or the state guard's operator log failing),
    When a batch is posted through the proxy, with and without an Idempotency-Key,
    Then the proxy answers 503 in the API's shape (nothing published; `"outcome": "unknown"` with a key: an earlier
    attempt under it may have been), and neither the bulk process nor the API's own batch route gets it (which would
    parse and publish it in the API process, beside the OTPs, once a second look at the key succeeded)."""
    import httpx

    def unreadable(token):
        raise failure

    async def api(scope, receive, send):
        pytest.fail("the API's own batch route must not get it")

    proxy = bulk.BulkProxy(api, None, unreadable)
    proxy.bulk = held = HeldBulk()

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy), base_url="http://api") as client:
            plain = await client.post(bulk.BATCH_PATH, content=b'{"sends": []}', headers={"authorization": "Bearer k"})
            keyed = await client.post(bulk.BATCH_PATH, content=b'{"sends": []}',
                                      headers={"authorization": "Bearer k", "idempotency-key": "k-1"})
            return plain, keyed

    plain, keyed = asyncio.run(scenario())
    assert plain.status_code == 503 and "nothing was published" in plain.text and "outcome" not in plain.json()
    assert keyed.status_code == 503 and keyed.json()["outcome"] == "unknown", keyed.text
    assert "an earlier attempt under this Idempotency-Key may have been" in keyed.text
    assert held.forwarded == 0 and proxy._forwarding == {}
