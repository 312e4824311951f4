"""A webhook delivery on a pooled connection that the receiver closed meanwhile is sent again on a new
connection within the same attempt, instead of counting as a failure against the endpoint's health."""

import asyncio
import time

import aiohttp

from streams.webhooks.delivery import post_delivery, reuse_tracer


async def _receiver(answered_per_connection: int) -> tuple[asyncio.base_events.Server, list[int]]:
    """A receiver that answers 204 to the first `answered_per_connection` requests of each connection, then
    closes it when the next request arrives, without answering (as a server that closed an idle
    connection just as the client reused it). Returns the server and the requests answered per connection."""
    answered: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answered.append(0)
        me = len(answered) - 1
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            if answered[me] == answered_per_connection:
                writer.close()
                return
            answered[me] += 1
            writer.write(b"HTTP/1.1 204 No Content\r\nConnection: keep-alive\r\n\r\n")
            await writer.drain()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, answered


def test_a_request_on_a_connection_the_receiver_closed_is_sent_again_on_a_new_one():
    """Given a receiver that closes a connection when its second request arrives, unanswered,
    When two deliveries are posted one after the other (the second reuses the pooled connection),
    Then both are delivered (204): the second was sent again on a new connection, and the receiver
    answered one request on each of the two connections."""

    async def scenario() -> None:
        server, answered = await _receiver(answered_per_connection=1)
        port = server.sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}/hook"
        async with server, _pooled() as session, _fresh() as fresh:
            first = await post_delivery(session, fresh, url, b"{}", {"webhook-id": "msg_1"}, time.monotonic(), 10.0)
            second = await post_delivery(session, fresh, url, b"{}", {"webhook-id": "msg_2"}, time.monotonic(), 10.0)
        assert (first.outcome, first.status) == ("delivered", 204)
        assert (second.outcome, second.status) == ("delivered", 204)
        assert answered == [1, 1]

    asyncio.run(scenario())


def test_the_second_try_never_takes_another_closed_connection_from_the_pool():
    """Given a receiver that closes a connection when its second request arrives, unanswered,
    and two pooled connections to it (two deliveries posted at once, then idle),
    When a third delivery is posted (its first try meets one closed connection, the other is closed too),
    Then it is delivered (204): its second try went out on a new connection, not on the other pooled one."""

    async def scenario() -> None:
        server, answered = await _receiver(answered_per_connection=1)
        port = server.sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}/hook"
        async with server, _pooled() as session, _fresh() as fresh:
            burst = await asyncio.gather(*(post_delivery(session, fresh, url, b"{}", {"webhook-id": f"msg_{i}"},
                                                         time.monotonic(), 10.0) for i in (1, 2)))
            assert [r.status for r in burst] == [204, 204] and answered == [1, 1]
            third = await post_delivery(session, fresh, url, b"{}", {"webhook-id": "msg_3"}, time.monotonic(), 10.0)
        assert (third.outcome, third.status) == ("delivered", 204)
        assert answered == [1, 1, 1]  # one on each pooled connection, the third on a new one

    asyncio.run(scenario())


def test_a_new_connection_the_receiver_closes_unanswered_is_a_failure_not_sent_again():
    """Given a receiver that closes every connection when its first request arrives, unanswered,
    When a delivery is posted (on a new connection: nothing pooled yet),
    Then the attempt fails (the receiver may have acted on it: only a pooled connection's failure is
    sent again) and the receiver saw one connection."""

    async def scenario() -> None:
        server, answered = await _receiver(answered_per_connection=0)
        port = server.sockets[0].getsockname()[1]
        async with server, _pooled() as session, _fresh() as fresh:
            try:
                await post_delivery(session, fresh, f"http://127.0.0.1:{port}/", b"{}", {}, time.monotonic(), 10.0)
            except aiohttp.ServerDisconnectedError:
                assert answered == [0]
                return
        raise AssertionError("a closed new connection was not reported")

    asyncio.run(scenario())


def _pooled() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(trace_configs=[reuse_tracer()])


def _fresh() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


def test_a_receiver_that_refuses_connections_is_not_asked_twice():
    async def scenario() -> None:
        server, _ = await _receiver(answered_per_connection=1)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        async with _pooled() as session, _fresh() as fresh:
            try:
                await post_delivery(session, fresh, f"http://127.0.0.1:{port}/", b"{}", {}, time.monotonic(), 10.0)
            except aiohttp.ClientConnectorError:
                return
        raise AssertionError("a refused connection was not reported")

    asyncio.run(scenario())
