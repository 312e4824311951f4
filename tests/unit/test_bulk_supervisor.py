"""The API's bulk process: its supervisor keeps starting it when a start itself fails, and the API bounds the
batches it forwards to it at once."""

import asyncio
import errno
import subprocess
import sys

from streams.ingest import bulk
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


def test_batches_forwarded_at_once_are_bounded_per_api_key_and_in_all(monkeypatch):
    """Given a bulk process slow to answer (a slow broker),
    When one API key posts more batches at once than FORWARDS_PER_KEY, and others fill FORWARDS_MAX,
    Then the key's extra batch (its scheme in another case, spaces around its token; or a made-up key in a second
    Authorization header, which the API does not read: before, counted under it, so one tenant's batches took every
    place) is answered 429 at once (with `"outcome": "unknown"` for a keyed batch: it may retry an attempt whose
    outcome was unknown),
    unpublished, while another key's goes on; past
    FORWARDS_MAX any batch is answered 503 (before: every batch was held, body and all, until the bulk process
    answered, and one client could run the API process, its single sends with it, out of memory); once answered,
    the key may post again."""
    import httpx

    monkeypatch.setattr(bulk, "FORWARDS_MAX", bulk.FORWARDS_PER_KEY + 2)
    proxy = bulk.BulkProxy(lambda scope, receive, send: None, None)
    proxy.bulk = held = HeldBulk()

    async def scenario():
        transport = httpx.ASGITransport(app=proxy)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            def post(key):
                return asyncio.create_task(client.post(bulk.BATCH_PATH, content=b'{"sends": []}',
                                                       headers={"authorization": f"Bearer {key}"}))

            first = [post("key-a") for _ in range(bulk.FORWARDS_PER_KEY)]
            while held.forwarded < bulk.FORWARDS_PER_KEY:
                await asyncio.sleep(0)
            extra = await asyncio.create_task(client.post(  # the same key, written otherwise: the same count
                bulk.BATCH_PATH, content=b'{"sends": []}', headers={"authorization": "bearer   key-a "}))
            # A second Authorization header after the key: the API authenticates the first, so it is counted so
            smuggled = await asyncio.wait_for(client.post(bulk.BATCH_PATH, content=b'{"sends": []}', headers=[
                ("authorization", "Bearer key-a"), ("authorization", "Bearer made-up")]), 10)  # held: forwarded
            keyed = await client.post(bulk.BATCH_PATH, content=b'{"sends": []}',
                                      headers={"authorization": "Bearer key-a", "idempotency-key": "k-1"})
            others = [post("key-b") for _ in range(2)]
            while held.forwarded < bulk.FORWARDS_PER_KEY + 2:
                await asyncio.sleep(0)
            full = await post("key-c")
            full_keyed = await client.post(bulk.BATCH_PATH, content=b'{"sends": []}',
                                           headers={"authorization": "Bearer key-d", "idempotency-key": "k-2"})
            held.answer.set()
            answered = [r.status_code for r in await asyncio.gather(*first, *others)]
            again = await post("key-a")
        return extra, smuggled, keyed, full, full_keyed, answered, again

    extra, smuggled, keyed, full, full_keyed, answered, again = asyncio.run(scenario())
    assert extra.status_code == 429 and extra.json()["error"] == "too_many_batches"
    assert smuggled.status_code == 429, smuggled.text
    assert extra.headers["retry-after"] == "1" and "key-a" not in extra.text
    assert full.status_code == 503 and "nothing was published" in full.text
    assert "outcome" not in extra.json() and "outcome" not in full.json()
    # A keyed batch may be the retry of an attempt left unknown: never told "not sent" (sent again under a new key)
    for refused, status in ((keyed, 429), (full_keyed, 503)):
        assert refused.status_code == status and refused.json()["outcome"] == "unknown", refused.text
        assert "an earlier attempt under this Idempotency-Key may have been" in refused.text
    assert answered == [202] * (bulk.FORWARDS_PER_KEY + 2) and again.status_code == 202
    assert proxy._forwarding == {}
