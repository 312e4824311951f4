"""A minimal HTTP/1.1 client over a Unix socket, for one job: the API process passing a batch, read
into memory, to its bulk process (uvicorn) and reading the answer back.

Why not httpx: the API process serves single sends at a higher CPU priority than batches, and every
millisecond it spends forwarding a batch is one a single send may wait for. Profiled under a batch
blast, httpx's request machinery was ~13% of the time the API process held the GIL; this client
writes one request head and reads one answer.

What the caller learns when it fails, the distinction the forwarding answer depends on:
- `Unreachable`: nothing was sent (no process listens on the socket).
- `Interrupted`: the request was written, or may have been, and no whole answer came back.
- `TimeoutError`: no whole answer within the time given (the other side may still act on it).
"""

from __future__ import annotations

import asyncio
import time
from typing import NamedTuple

# A kept-alive connection is not reused after this long idle: uvicorn closes idle connections after
# 5 s, and a request written into one it is closing would look Interrupted (published or not?).
IDLE_REUSE_S = 2.0
# Kept-alive connections kept at most: a burst of batches opens one each, and steady traffic after it reuses
# only the newest, so the rest would stay open (file descriptors the API process needs) until they are reused.
MAX_IDLE = 16


class Unreachable(Exception):
    """Nothing was sent: no process accepts connections on the socket."""


class Interrupted(Exception):
    """The request was (or may have been) received, but no whole answer came back."""


class Answer(NamedTuple):
    status: int
    headers: list[tuple[bytes, bytes]]  # as received, names lower-cased
    body: bytes


class UnixHttp:
    def __init__(self, socket_path: str, host: bytes = b"localhost"):
        self.socket_path = socket_path
        self.host = host
        self._idle: list[tuple[float, asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def request(self, method: str, target: str, headers: list[tuple[bytes, bytes]], body: list[bytes],
                      timeout_s: float) -> Answer:
        """One request; `headers` must not hold host, content-length or hop-by-hop headers."""
        reader, writer = await self._connection()
        head = b"".join([f"{method} {target} HTTP/1.1\r\n".encode("latin-1"), b"host: ", self.host,
                         b"\r\ncontent-length: ", str(sum(map(len, body))).encode(), b"\r\n",
                         *(name + b": " + value + b"\r\n" for name, value in headers), b"\r\n"])
        try:
            async with asyncio.timeout(timeout_s):
                writer.write(head)
                writer.writelines(body)
                await writer.drain()
                answer, keep_alive = await _read_answer(reader)
        except TimeoutError:
            writer.close()
            raise
        except (OSError, EOFError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            writer.close()
            raise Interrupted(f"{type(exc).__name__}: {exc}") from exc
        except BaseException:  # cancelled: the connection is in an unknown state
            writer.close()
            raise
        if keep_alive and len(self._idle) < MAX_IDLE:
            self._idle.append((time.monotonic(), reader, writer))
        else:
            writer.close()
        return answer

    async def close(self) -> None:
        while self._idle:
            self._idle.pop()[2].close()

    async def _connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The newest kept-alive connection still fit for reuse (every other unfit one is closed), else a new one."""
        now = time.monotonic()
        fit = []
        for since, reader, writer in self._idle:
            if now - since < IDLE_REUSE_S and not reader.at_eof() and not writer.is_closing():
                fit.append((since, reader, writer))
            else:
                writer.close()
        self._idle = fit
        if self._idle:
            _, reader, writer = self._idle.pop()
            return reader, writer
        try:
            return await asyncio.open_unix_connection(self.socket_path)
        except OSError as exc:
            raise Unreachable(f"{type(exc).__name__}: {exc}") from exc


async def _read_answer(reader: asyncio.StreamReader) -> tuple[Answer, bool]:
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *lines = head[:-4].split(b"\r\n")
    version, status = status_line.split(b" ", 2)[:2]
    if not version.startswith(b"HTTP/1."):
        raise ValueError(f"not an HTTP/1.x answer: {status_line[:40]!r}")
    headers = []
    for line in lines:
        name, _, value = line.partition(b":")
        headers.append((name.strip().lower(), value.strip()))
    fields = dict(headers)
    if b"content-length" in fields:
        body = await reader.readexactly(int(fields[b"content-length"]))
    elif fields.get(b"transfer-encoding", b"").lower() == b"chunked":
        body = await _read_chunked(reader)
    else:
        raise ValueError("an answer with neither content-length nor chunked encoding")
    keep_alive = version == b"HTTP/1.1" and fields.get(b"connection", b"").lower() != b"close"
    return Answer(int(status), headers, body), keep_alive


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0].strip(), 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, if any
                pass
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)
