"""Looking up the names of webhook receivers: by c-ares (`aiodns`) on an event loop, so that a lookup waiting for
a name server that never answers (a tenant's, down) holds a timer, not a thread. Before, lookups ran on pools
of 32 threads, each kept until the system resolver gave up: the silent name servers of a few tenants held all
of them, and every other tenant's lookups waited and failed too."""

from __future__ import annotations

import asyncio
import socket
import threading

import aiodns
from aiodns import error as dns_errors

QUERY_TIMEOUT_S = 1.0  # the resolver's wait for one answer before it asks again (QUERY_TRIES in all)
QUERY_TRIES = 2
BLOCKING_TIMEOUT_S = 5.0  # how long a registration waits for its lookup


class LookupFailed(OSError):
    """The name could not be looked up now (a name server down or unreachable, ours or the tenant's): not an
    answer about the name, so not cached. It counts against the endpoint's health like any failed attempt: a
    tenant whose name servers stay down is told, as for a receiver that stays down."""


# Answers about the name: it does not exist, has no address, or is not one a name server can hold.
NO_SUCH_NAME = frozenset({dns_errors.ARES_ENOTFOUND, dns_errors.ARES_ENODATA, dns_errors.ARES_ENONAME,
                          dns_errors.ARES_EBADNAME})
# Not asked again: the resolver already asked QUERY_TRIES times, or is closing.
GIVEN_UP = frozenset({dns_errors.ARES_ETIMEOUT, dns_errors.ARES_ECANCELLED, dns_errors.ARES_EDESTRUCTION})


async def name_resolver(nameservers: list[str] | None = None) -> aiodns.DNSResolver:
    """A resolver on the running loop, asking `nameservers` ("127.0.0.1:5353"...) or else the machine's."""
    return aiodns.DNSResolver(nameservers=nameservers, loop=asyncio.get_running_loop(), timeout=QUERY_TIMEOUT_S,
                              tries=QUERY_TRIES)


async def addresses_of(names: aiodns.DNSResolver, host: str, tries: int = 2) -> list[str]:
    """The host's addresses: [] when the name does not exist (or is not one a name server can hold);
    LookupFailed when the lookup itself failed `tries` times in a row (a name server's bad moment passes).
    A name server that does not answer is not asked again here (GIVEN_UP)."""
    for tried in range(1, tries + 1):
        try:
            found = await names.getaddrinfo(host, family=socket.AF_UNSPEC)
            return sorted({_text(node.addr[0]) for node in found.nodes})
        except dns_errors.DNSError as exc:
            code = exc.args[0] if exc.args else None
            if code in NO_SUCH_NAME:
                return []
            failure = str(exc.args[1]) if len(exc.args) > 1 else "the lookup failed"
            if code in GIVEN_UP:
                raise LookupFailed(failure) from None
        except (UnicodeError, ValueError):  # a name the resolver cannot even encode
            return []
        if tried == tries:
            raise LookupFailed(failure)
    raise AssertionError("unreachable")


def _text(address: bytes | str) -> str:
    return address.decode() if isinstance(address, bytes) else address


class BlockingResolver:
    """Lookups for code that waits for them (a registration's URL check): made on an event loop of its own,
    each waited for at most BLOCKING_TIMEOUT_S (TimeoutError, an OSError: "does not resolve"), so a tenant's
    silent name server holds its own registration that long and nobody else's."""

    def __init__(self, nameservers: list[str] | None = None):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="url-check-dns", daemon=True)
        self._thread.start()
        self.names = asyncio.run_coroutine_threadsafe(name_resolver(nameservers), self.loop).result(10)

    def __call__(self, host: str) -> list[str]:
        lookup = asyncio.run_coroutine_threadsafe(addresses_of(self.names, host), self.loop)
        try:
            return lookup.result(timeout=BLOCKING_TIMEOUT_S)
        except TimeoutError:
            lookup.cancel()
            raise

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.names.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


_system: BlockingResolver | None = None
_system_lock = threading.Lock()


def system_resolver(host: str) -> list[str]:
    """The host's addresses by the machine's name servers ([] or OSError: it does not resolve)."""
    global _system
    with _system_lock:
        if _system is None:
            _system = BlockingResolver()
    return _system(host)
