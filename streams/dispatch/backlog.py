"""How much of a worker's buffer one tenant may hold, and when its excess is due back. Pure code.

A tenant whose bucket lets it send `rate` messages a second only needs the next few seconds of its
work in memory. Holding more hurts everyone else: the worker's buffer fills (and it pauses every
partition), and the tenant's unfinished messages pin the committed offset, so the lane's lag counts
work held back by that tenant's own limit (which makes every tenant's marketing yield and pages
on-call). So each tenant gets a share of `rate x horizon_s` messages (at least one request's worth,
at most `max_share`); past it, further messages are parked on a retry tier, due back about when
their turn would have come, which lets the partition's committed offset move on.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class BacklogShare:
    horizon_s: float = 5.0
    max_share: int = 5_000
    _parked: dict[str, deque[float]] = field(default_factory=dict)  # tenant -> due times still ahead

    def share(self, rate: float, per_request: int) -> int:
        """Messages a tenant may hold in the worker's buffer."""
        return max(per_request, min(self.max_share, int(rate * self.horizon_s)))

    def due_in(self, tenant: str, queued: int, rate: float, now: float) -> float:
        """Seconds until a message parked now is due back: after the tenant's queue and what it
        parked before (still ahead) have gone out at its rate."""
        parked = self._parked.setdefault(tenant, deque())
        while parked and parked[0] <= now:
            parked.popleft()
        wait = (queued + len(parked) + 1) / max(rate, 1e-6)
        parked.append(now + wait)
        return wait
