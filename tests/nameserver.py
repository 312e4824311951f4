"""A name server on loopback UDP for the webhook tests: the delivery client's real resolver (c-ares) asks it
as it would ask any name server. Each name in `names` answers with its IPv4 address (and no IPv6 one); a name
in `silent` is never answered (a tenant's name server that is down); a name in `failing` gets SERVFAIL; a name
in `slow` is answered (as one of `names`) that many seconds late; any other name gets NXDOMAIN."""

from __future__ import annotations

import socket
import struct
import threading
from collections import Counter

NOERROR, SERVFAIL, NXDOMAIN = 0, 2, 3
TYPE_A = 1


def question_of(query: bytes) -> tuple[str, int, bytes]:
    """The queried name, its type, and the question section's bytes (echoed in the answer)."""
    labels, at = [], 12
    while query[at]:
        labels.append(query[at + 1:at + 1 + query[at]].decode("ascii", "replace"))
        at += query[at] + 1
    qtype = struct.unpack("!H", query[at + 1:at + 3])[0]
    return ".".join(labels).lower(), qtype, query[12:at + 5]


def answer(query: bytes, rcode: int, address: str | None) -> bytes:
    _, _, question = question_of(query)
    flags = 0x8180 | (query[2] & 0x01) << 8 | rcode  # a response, recursion desired (as asked) and available
    records = b""
    if address is not None:  # pointer to the question's name, type A, class IN, TTL 60, 4 bytes
        records = b"\xc0\x0c" + struct.pack("!HHIH", TYPE_A, 1, 60, 4) + socket.inet_aton(address)
    header = query[:2] + struct.pack("!HHHHH", flags, 1, 1 if records else 0, 0, 0)
    return header + question + records


class LoopbackNameServer:
    def __init__(self, names: dict[str, str] | None = None, silent: set[str] | None = None,
                 failing: set[str] | None = None, slow: dict[str, float] | None = None):
        self.names, self.silent, self.failing = dict(names or {}), set(silent or ()), set(failing or ())
        self.slow = dict(slow or {})
        self.asked: Counter[str] = Counter()  # queries per name (a lookup asks for A and AAAA)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.1)  # how often the serving thread looks whether it was closed
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="loopback-nameserver", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                query, peer = self.sock.recvfrom(4096)
            except TimeoutError:
                continue
            try:
                name, qtype, _ = question_of(query)
            except (IndexError, struct.error):
                continue
            self.asked[name] += 1
            if name in self.silent:
                continue
            if name in self.failing:
                reply = answer(query, SERVFAIL, None)
            elif name in self.names:
                reply = answer(query, NOERROR, self.names[name] if qtype == TYPE_A else None)
            else:
                reply = answer(query, NXDOMAIN, None)
            if name in self.slow:
                threading.Timer(self.slow[name], self._send, (reply, peer)).start()
            else:
                self._send(reply, peer)

    def _send(self, reply: bytes, peer: tuple[str, int]) -> None:
        if not self._closed.is_set():
            self.sock.sendto(reply, peer)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(5)
        self.sock.close()

    def __enter__(self) -> LoopbackNameServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
