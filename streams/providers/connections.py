"""Pooled connections to a provider, and the one failure pooling adds.

A provider, like most servers, closes a connection that sat idle (uvicorn and Node after 5 s). The pool lets
one go after KEEPALIVE_S, before those would; a request that still goes out on a connection the server is
closing at that moment (or one a server with a shorter keep-alive closed) fails before any answer. `post`
tells that case from the others by the request's trace (it began sending its headers on a connection it did
not open, and no answer's headers were read) and, if the caller allows, sends the request once more through
a client that never reuses a connection.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx

KEEPALIVE_S = 4.0  # below the 5 s after which common servers (uvicorn, Node) close an idle connection
CONNECT_S = 3.0
MAX_ANSWER_BYTES = 1 << 20  # what of an answer's body is kept: a provider's answers are a few kB


class _Trace:
    """The httpcore trace events of one request (`extensions={"trace": ...}`)."""

    def __init__(self) -> None:
        self.events: set[str] = set()

    def __call__(self, event: str, info: dict) -> None:
        self.events.add(event)

    def closed_while_idle(self) -> bool:
        """Sent on a reused connection (none opened for it), which closed before any answer began."""
        opened = any(event.startswith("connection.connect_") for event in self.events)
        return ("http11.send_request_headers.started" in self.events and not opened
                and "http11.receive_response_headers.complete" not in self.events)


def post(pooled: httpx.Client, fresh: httpx.Client, path: str, content: bytes, headers: dict[str, str],
         seconds_left: Callable[[], float], again: Callable[[], bool]) -> httpx.Response:
    """POST through `pooled`. A request that met a connection the provider closed while it sat idle is sent
    once more through `fresh` when `again()` says so (it is asked only then, so it may log and record the
    second copy); `seconds_left()` bounds each of its reads and writes (its connect: CONNECT_S at most), and the
    whole answer.
    Any other failure is raised as it came."""
    trace = _Trace()
    try:
        return _read_within(pooled.send(pooled.build_request("POST", path, content=content, headers=headers,
                                                             extensions={"trace": trace}), stream=True), seconds_left)
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
        if not trace.closed_while_idle():
            raise  # a new connection, or one that answered: another is no different
        left = seconds_left()
        if left <= 0 or not again():
            raise
        return _read_within(fresh.send(fresh.build_request("POST", path, content=content, headers=headers, timeout=(
            httpx.Timeout(left, connect=min(left, CONNECT_S)))), stream=True), seconds_left)


def _read_within(resp: httpx.Response, seconds_left: Callable[[], float]) -> httpx.Response:
    """`resp` with its whole body, read before `seconds_left()` runs out. The client's timeout bounds each read,
    not the whole: a body that arrives a byte at a time, never silent for a whole timeout, held the request (its
    worker slot, its lease kept alive, its partition's commit) for as long as the sender went on. A body longer
    than MAX_ANSWER_BYTES is cut there (the rest is not read): held whole, hundreds of MB from a misbehaving
    provider or proxy, 32 requests at once, ran the worker out of memory. A cut answer says so (its extension
    `cut`): what it named is unknown, and an error is classed by its status."""
    if resp.is_stream_consumed:  # read whole already (a transport answering from memory)
        return resp
    declared = resp.headers.get("content-length", "")
    length = int(declared) if declared.isdigit() else None
    # Kept as the bytes came, never decoded: requests ask for an answer uncompressed, and one compressed anyway
    # could decode to gigabytes from a MiB (it reads as unreadable).
    headers = [(k, v) for k, v in resp.headers.multi_items() if k.lower() != "content-encoding"]
    chunks: list[bytes] = []
    received = 0
    try:
        for chunk in resp.iter_raw():
            chunks.append(chunk)
            received += len(chunk)
            if received > MAX_ANSWER_BYTES:
                return httpx.Response(resp.status_code, headers=headers, content=b"".join(chunks)[:MAX_ANSWER_BYTES],
                                      request=resp.request, extensions={"cut": True})
            # An answer whose whole body is in (its declared length) is used, however late it came.
            if seconds_left() <= 0 and (length is None or received < length):
                raise httpx.ReadTimeout("the answer's body was still arriving when the request's time ran out",
                                        request=resp.request)
    finally:
        resp.close()
    return httpx.Response(resp.status_code, headers=headers, content=b"".join(chunks), request=resp.request)
