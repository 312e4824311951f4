"""A lane worker's providers: the channel's providers in fallback order, each with its adapter, its
credentials and its pacing. Every send goes to the first provider, unless a retry copy names
another (`provider` header: a fallback); `fallback_for` says when the next one may be tried.

Pacing (operators change it at run time, read from the limits every few seconds): at most
`concurrency` requests in flight to the provider per worker, and at least `pause_ms` between one
wave of requests and the next.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from .. import metrics
from ..errors import ConfigError, StoreUnavailable
from ..gate.gate import Gate
from ..gate.limits import Pacing
from ..providers.http import Provider
from ..providers.outcome import ProviderResult
from ..providers.registry import ProviderCredentials, ProviderSpec

log = logging.getLogger("streams.dispatch")
PACING_TTL_S = 2.0


@dataclass
class Route:
    spec: ProviderSpec
    adapter: Provider
    credentials: ProviderCredentials
    pacing: Pacing = Pacing()
    slots: int | None = None    # the worker's own requests in flight at most (its --concurrency); None: no bound
    in_flight: int = 0
    next_wave_at: float = 0.0   # monotonic: no new request before this (the pause after a wave)
    shared_account_held_until: float = 0.0  # monotonic: the account every tenant shares was refused until then

    def shares_account(self, tenant: str) -> bool:
        """Whether this tenant's requests go under the token or key every tenant shares (not a key of its own)."""
        return self.spec.auth == "token" or not self.credentials.has_own_key(tenant)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def cap(self) -> int:
        """Requests in flight per worker, at most: the operator's pacing, else providers.toml's, and
        never more than the worker's own slots (pacing above them changes nothing on this worker)."""
        cap = self.pacing.concurrency or self.spec.concurrency
        return min(cap, self.slots) if self.slots else cap

    def room(self, now: float) -> int:
        """Requests that may start now."""
        return 0 if now < self.next_wave_at else max(0, self.cap - self.in_flight)

    def wave_started(self, now: float) -> None:
        if self.pacing.pause_ms:
            self.next_wave_at = now + self.pacing.pause_ms / 1000


class Routes:
    def __init__(self, routes: list[Route], gate: Gate | None = None):
        if not routes:
            raise ValueError("a worker needs at least one provider")
        self.order = routes
        self.by_name = {r.name: r for r in routes}
        self.primary = routes[0]
        self.gate = gate
        self._pacing_read_at = 0.0

    def of(self, provider: str) -> Route:
        """The route a message goes by ("" or an unknown name: the first provider)."""
        return self.by_name.get(provider) or self.primary

    def fallback_for(self, route: Route, result: ProviderResult, tried: list[str]) -> Route | None:
        """The next provider for a send `route` rejected, when the rejection is one of `route`'s named
        fallback reasons and the next provider has not been tried: at most one more, never back."""
        if result.outcome != "rejected" or result.error_name not in route.spec.fallback_errors:
            return None
        position = self.order.index(route)
        following = self.order[position + 1:position + 2]
        return following[0] if following and following[0].name not in tried else None

    def refresh_pacing(self) -> None:
        """Read each provider's pacing from the limits, at most every PACING_TTL_S."""
        now = time.monotonic()
        if self.gate is None or now - self._pacing_read_at < PACING_TTL_S:
            return
        self._pacing_read_at = now
        for route in self.order:
            try:
                pacing = self.gate.pacing(route.name)
            except StoreUnavailable as exc:
                log.debug("pacing of %s not read: %s", route.name, exc)
                continue
            except ConfigError as exc:  # a field edited by hand: the pacing it had goes on
                log.error("pacing of %s not read: %s", route.name, exc)
                continue
            if pacing != route.pacing:
                route.pacing = pacing
                log.info("provider %s pacing now: concurrency %s, pause %d ms; this worker: at most %d in flight",
                         route.name, pacing.concurrency or f"{route.spec.concurrency} (default)", pacing.pause_ms,
                         route.cap)
            metrics.PACING.labels(route.name, "concurrency").set(route.cap)
            metrics.PACING.labels(route.name, "pause_ms").set(route.pacing.pause_ms)

    def close(self) -> None:
        for route in self.order:
            route.adapter.close()
