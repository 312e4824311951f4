"""How much of a worker's buffer one tenant may hold, and when its excess is due back. Pure code.

A tenant whose bucket lets it send `rate` messages a second only needs the next few seconds of its
work in memory. Holding more hurts everyone else: the worker's buffer fills (and it pauses every
partition), and the tenant's unfinished messages pin the committed offset, so the lane's lag counts
work held back by that tenant's own limit (which makes every tenant's marketing yield and pages
on-call). So a tenant may hold `rate x horizon_s` messages (at least one request's worth, at most
`max_share`); a message past that, whose turn is at least `horizon_s` away, is parked on a retry
tier, due back about when its turn would have come, which lets the partition's committed offset
move on. A fast tenant whose turn is near is never parked (that would only churn the tier); the
worker's overall buffer bound still holds its memory.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class BacklogShare:
    horizon_s: float = 10.0
    max_share: int = 5_000
    _parked: dict[str, deque[float]] = field(default_factory=dict)  # tenant -> due times still ahead

    def share(self, rate: float, per_request: int) -> int:
        """Messages a tenant may hold in the worker's buffer."""
        return max(per_request, min(self.max_share, int(rate * self.horizon_s)))

    def excess(self, queued: int, rate: float, per_request: int) -> int:
        """How many of `queued` messages lie past the tenant's share and might be parked (0 when within it, or
        when the turn of the first one past it is near anyway, which `park` would never park)."""
        share = self.share(rate, per_request)
        if queued <= share or (share + 1) / max(rate, 1e-6) < self.horizon_s:
            return 0
        return queued - share

    def park(self, tenant: str, queued: int, rate: float, per_request: int, now: float) -> float | None:
        """Seconds until a message arriving now is due back, when it should be parked; None when it
        should be queued (the tenant is within its share, or its turn is near anyway)."""
        if queued < self.share(rate, per_request):
            return None
        parked = self._parked.setdefault(tenant, deque())
        while parked and parked[0] <= now:
            parked.popleft()
        wait = (queued + len(parked) + 1) / max(rate, 1e-6)
        if wait < self.horizon_s:
            return None
        parked.append(now + wait)
        return wait
