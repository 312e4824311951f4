"""The API process's HTTP/1.1 client to its bulk process, against a real Unix-socket server that
answers as scripted: lengths, chunks, keep-alive, and the three ways a forward can fail."""

import asyncio

import pytest

from streams.ingest import unix_http
from streams.ingest.unix_http import Interrupted, UnixHttp, Unreachable


class Server:
    """Reads whole requests (head + content-length body) and answers each with the next scripted
    bytes; None closes the connection without an answer, "hang" never answers."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.requests: list[bytes] = []
        self.connections = 0
        self.handlers: list[asyncio.Task] = []

    async def handle(self, reader, writer):
        self.connections += 1
        self.handlers.append(asyncio.current_task())
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                self.requests.append(head + await reader.readexactly(length))
                answer = self.answers.pop(0)
                if answer is None:
                    break
                if answer == "hang":
                    await asyncio.Event().wait()
                writer.write(answer)
                await writer.drain()
        except asyncio.IncompleteReadError:
            pass
        writer.close()


async def serving(tmp_path, answers):
    server = Server(answers)
    path = str(tmp_path / "s.sock")
    listener = await asyncio.start_unix_server(server.handle, path)
    return server, listener, UnixHttp(path, host=b"bulk")


def test_answers_with_a_length_or_in_chunks_come_back_whole_over_one_kept_alive_connection(tmp_path):
    """Given a server answering once with content-length and once chunked (with a trailer),
    When two requests are made one after the other,
    Then both answers arrive whole with their status and lower-cased headers, the request carries its host, length
    and headers, and the second request reuses the first one's connection."""
    async def scenario():
        server, listener, client = await serving(tmp_path, [
            b"HTTP/1.1 202 Accepted\r\nContent-Length: 5\r\nIdempotent-Replayed: true\r\n\r\nhello",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\nT: 1\r\n\r\n",
        ])
        async with listener:
            first = await client.request("POST", "/v1/sends/batch", [(b"authorization", b"Bearer k")],
                                         [b'{"sends"', b": []}"], 5)
            second = await client.request("GET", "/metrics/", [], [], 5)
            await client.close()
            await asyncio.gather(*server.handlers)  # each ends on the client's close
        return server, first, second

    server, first, second = asyncio.run(scenario())
    assert (first.status, first.body) == (202, b"hello")
    assert (b"idempotent-replayed", b"true") in first.headers
    assert (second.status, second.body) == (200, b"abcde")
    assert server.requests[0] == (b"POST /v1/sends/batch HTTP/1.1\r\nhost: bulk\r\ncontent-length: 13\r\n"
                                  b"authorization: Bearer k\r\n\r\n{\"sends\": []}")
    assert server.connections == 1


def test_a_connection_the_server_closes_or_that_sat_idle_is_not_reused(tmp_path, monkeypatch):
    """Given answers with `Connection: close`, then a kept-alive answer followed by a pause past IDLE_REUSE_S,
    Then every request after them opens a new connection (none is written into a closing one)."""
    monkeypatch.setattr(unix_http, "IDLE_REUSE_S", 0.0)
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"

    async def scenario():
        server, listener, client = await serving(tmp_path, [
            b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", ok, ok])
        async with listener:
            for _ in range(3):
                assert (await client.request("GET", "/", [], [], 5)).status == 200
        return server

    assert asyncio.run(scenario()).connections == 3


def test_the_three_failures_are_told_apart(tmp_path):
    """Given no server at all, a server that reads the request and closes without answering, and one that never
    answers,
    Then the first is Unreachable (nothing sent), the second Interrupted (it may have acted on it), the third a
    TimeoutError after the time given."""
    async def scenario():
        with pytest.raises(Unreachable):
            await UnixHttp(str(tmp_path / "none.sock")).request("POST", "/", [], [b"x"], 5)
        server, listener, client = await serving(tmp_path, [None, "hang"])
        async with listener:
            with pytest.raises(Interrupted):
                await client.request("POST", "/", [], [b"x"], 5)
            with pytest.raises(TimeoutError):
                await client.request("POST", "/", [], [b"x"], 0.2)
        return server

    assert len(asyncio.run(scenario()).requests) == 2


@pytest.mark.parametrize("key", [None, "batch-7"])
def test_a_batch_the_bulk_process_dropped_unanswered_tells_the_client_how_to_retry_safely(tmp_path, key):
    """Given a bulk process that closes the connection without answering a batch (it may have published it),
    When a client posts the batch through the API process, with or without an Idempotency-Key,
    Then the answer is 503 `"outcome": "unknown"`; with a key it says to retry with the same key, without one it
    says a retry is published under new send ids (before: it told a client without a key to reuse its key)."""
    import httpx

    from streams.ingest.api_keys import Principal
    from streams.ingest.bulk import BulkProxy

    async def scenario():
        server, listener, _ = await serving(tmp_path, [None])
        async with listener:
            proxy = BulkProxy(None, str(tmp_path / "s.sock"), lambda token: Principal("tenant", "acme", "k1"))
            transport = httpx.ASGITransport(proxy)
            async with httpx.AsyncClient(transport=transport, base_url="http://api") as http:
                return await http.post("/v1/sends/batch", json={"sends": []}, headers={
                    "Authorization": "Bearer dr_ten_x", **({"Idempotency-Key": key} if key else {})})

    r = asyncio.run(scenario())
    assert r.status_code == 503 and r.json()["outcome"] == "unknown", r.text
    if key:
        assert "same Idempotency-Key" in r.text
    else:
        assert "Idempotency-Key" in r.text and "same Idempotency-Key" not in r.text and "new send ids" in r.text


@pytest.mark.parametrize("key", [None, "batch-7"])
def test_a_batch_meeting_no_bulk_process_says_whether_an_earlier_attempt_may_have_published(tmp_path, key):
    """Given no bulk process listening (being started again), When a batch is posted, Then 503: without a key,
    nothing was published; with one, `"outcome": "unknown"`, as an earlier attempt under the key (the one that
    met the process stopping) may have been published: retry with the same key (before: "nothing was published")."""
    import httpx

    from streams.ingest.api_keys import Principal
    from streams.ingest.bulk import BulkProxy

    async def scenario():
        proxy = BulkProxy(None, str(tmp_path / "absent.sock"), lambda token: Principal("tenant", "acme", "k1"))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(proxy), base_url="http://api") as http:
            return await http.post("/v1/sends/batch", json={"sends": []},
                                   headers={"Authorization": "Bearer dr_ten_x", **({"Idempotency-Key": key} if key else {})})

    r = asyncio.run(scenario())
    assert r.status_code == 503, r.text
    if key:
        assert r.json()["outcome"] == "unknown" and "same Idempotency-Key" in r.text
    else:
        assert "outcome" not in r.json() and "nothing was published" in r.text



def test_after_a_burst_the_connections_kept_are_bounded_and_those_sat_idle_are_closed(tmp_path, monkeypatch):
    """Given 40 batches forwarded at once (a connection each), then, past IDLE_REUSE_S, one more,
    Then at most MAX_IDLE connections are kept after the burst, and the one after it closes every connection that
    sat idle and keeps one (before: all 40 were kept, and steady traffic reusing the newest never closed the
    others: file descriptors held until the next peak, then more)."""
    clock = [1000.0]
    monkeypatch.setattr(unix_http.time, "monotonic", lambda: clock[0])
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

    async def scenario():
        server, listener, client = await serving(tmp_path, [answer] * 41)
        async with listener:
            await asyncio.gather(*(client.request("POST", "/v1/sends/batch", [], [b"{}"], 5) for _ in range(40)))
            kept_after_burst = len(client._idle)
            clock[0] += unix_http.IDLE_REUSE_S + 1
            await client.request("POST", "/v1/sends/batch", [], [b"{}"], 5)
            kept_after = len(client._idle)
            await client.close()
            await asyncio.gather(*server.handlers)  # each ends on the client's close
        return server, kept_after_burst, kept_after

    server, kept_after_burst, kept_after = asyncio.run(scenario())
    assert server.connections == 41 and kept_after_burst == unix_http.MAX_IDLE and kept_after == 1
