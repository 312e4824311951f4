"""Looking up the names of webhook receivers: by c-ares (`aiodns`) on an event loop, so that a lookup waiting for
a name server that never answers (a tenant's, down) holds a timer, not a thread. Before, lookups ran on pools
of 32 threads, each kept until the system resolver gave up: the silent name servers of a few tenants held all
of them, and every other tenant's lookups waited and failed too."""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
import time
from collections.abc import Callable

import aiodns
from aiodns import error as dns_errors

# The resolver's first wait for an answer before it asks again, QUERY_TRIES times in all, each wait twice the
# last. c-ares shortens the first wait once its name server has answered others fast (to about 250 ms): four
# tries still wait about 3.75 s in all for a name whose own name servers are slow (two waited 0.75 s). A lookup
# is given up after LOOKUP_WITHIN_S whatever the resolver would still wait (15 s before it has seen answers).
QUERY_TIMEOUT_S = 1.0
QUERY_TRIES = 4
LOOKUP_WITHIN_S = 5.0  # a lookup with no answer by then has failed
BLOCKING_TIMEOUT_S = 5.0  # how long a registration waits for its lookup


class LookupFailed(OSError):
    """The name could not be looked up now (a name server down or unreachable, ours or the tenant's): not an
    answer about the name, so not cached. It counts against the endpoint's health like any failed attempt (a
    tenant whose name servers stay down is told, as for a receiver that stays down), unless lookups and connections
    fail for every tenant at once: then it is ours (`egress_unavailable`, egress.py)."""


# Answers about the name: it does not exist, has no address, or is not one a name server can hold.
NO_SUCH_NAME = frozenset({dns_errors.ARES_ENOTFOUND, dns_errors.ARES_ENODATA, dns_errors.ARES_ENONAME,
                          dns_errors.ARES_EBADNAME})
# Not asked again: the resolver asked QUERY_TRIES times already, or is being closed.
GIVEN_UP = frozenset({dns_errors.ARES_ETIMEOUT, dns_errors.ARES_ECANCELLED, dns_errors.ARES_EDESTRUCTION})


async def name_resolver(nameservers: list[str] | None = None) -> aiodns.DNSResolver:
    """A resolver on the running loop, asking `nameservers` ("127.0.0.1:5353"...) or else the machine's."""
    return aiodns.DNSResolver(nameservers=nameservers, loop=asyncio.get_running_loop(), timeout=QUERY_TIMEOUT_S,
                              tries=QUERY_TRIES)


async def addresses_of(names: aiodns.DNSResolver, host: str, within_s: float = LOOKUP_WITHIN_S,
                       tries: int = 2) -> list[str]:
    """The host's addresses: [] when the name does not exist (or is not one a name server can hold);
    LookupFailed when the lookup itself failed `tries` times in a row (a name server's bad moment passes), or
    found no answer within `within_s` (the resolver alone would wait up to 15 s for a silent name server)."""
    deadline = time.monotonic() + within_s
    for tried in range(1, tries + 1):
        try:
            found = await asyncio.wait_for(names.getaddrinfo(host, family=socket.AF_UNSPEC),
                                           max(0.0, deadline - time.monotonic()))
            return sorted({_text(node.addr[0]) for node in found.nodes})
        except TimeoutError:
            raise LookupFailed(f"no answer within {within_s:g} s") from None
        except dns_errors.DNSError as exc:
            code = exc.args[0] if exc.args else None
            if code in NO_SUCH_NAME:
                return []
            failure = str(exc.args[1]) if len(exc.args) > 1 else "the lookup failed"
            if code in GIVEN_UP:
                raise LookupFailed(failure) from None
        except (UnicodeError, ValueError):  # a name the resolver cannot even encode
            return []
        except RuntimeError as exc:  # the resolver was closed (the process is stopping)
            raise LookupFailed(str(exc)) from None
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

    def _lookup(self, host: str) -> concurrent.futures.Future[list[str]]:
        return asyncio.run_coroutine_threadsafe(addresses_of(self.names, host, BLOCKING_TIMEOUT_S), self.loop)

    def __call__(self, host: str) -> list[str]:
        lookup = self._lookup(host)
        try:
            return lookup.result(timeout=BLOCKING_TIMEOUT_S)
        except TimeoutError:
            lookup.cancel()
            raise

    async def addresses(self, host: str) -> list[str]:
        """The same lookup, awaited on the caller's own event loop (an API request's): no thread waits for it."""
        return await asyncio.wait_for(asyncio.wrap_future(self._lookup(host)), BLOCKING_TIMEOUT_S)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.names.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()


class SystemResolver:
    """The machine's name servers, by a BlockingResolver started at first use (one per process)."""

    def __init__(self) -> None:
        self._resolver: BlockingResolver | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start it now (the API does, before serving: its first lookup must not start it on the event loop)."""
        self._started()

    def _started(self) -> BlockingResolver:
        with self._lock:
            if self._resolver is None:
                self._resolver = BlockingResolver()
            return self._resolver

    def __call__(self, host: str) -> list[str]:
        """The host's addresses ([] or OSError: it does not resolve)."""
        return self._started()(host)

    async def addresses(self, host: str) -> list[str]:
        return await self._started().addresses(host)


system_resolver = SystemResolver()


def answered(host: str, addresses: list[str] | None) -> Callable[[str], list[str]]:
    """A resolver answering for `host` what a lookup made before found (None: it failed), for a check that
    must not wait for a name server on its thread."""
    def resolve(name: str) -> list[str]:
        if name != host or addresses is None:
            raise OSError(f"{name} does not resolve")
        return addresses

    return resolve
