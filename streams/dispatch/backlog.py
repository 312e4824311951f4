"""How much of a worker's buffer one tenant may hold, and when its excess is due back. Pure code.

A tenant whose bucket lets it send `rate` messages a second (and `burst` at once when it has not been
sending) only needs the next few seconds of its work in memory. Holding more hurts everyone else: the
worker's buffer fills (and it pauses every partition), and the tenant's unfinished messages pin the
committed offset, so the lane's lag counts work held back by that tenant's own limit (which makes every
tenant's marketing yield and pages on-call). So a tenant may hold what its bucket lets go within
`horizon_s` (at least one request's worth, at most `max_share`; while its bucket lets none go within it,
under one a second on the transactional lane while its bucket is dry, one message of a queue not held, which
asks the gate, and none of a queue held); a message past that, whose turn is at least
`horizon_s` away, is parked on a retry tier, due back about when its turn would have come, which lets
the partition's committed offset move on. A fast tenant whose turn is near is never parked (that
would only churn the tier); the worker's overall buffer bound still holds its memory.

Where queues are webhook endpoints, an endpoint whose requests fail drains more slowly than its tenant's
bucket (one request at a time, each taking up to the attempt timeout): the worker then passes the rate
and burst it can actually send at (`Dispatcher.drain`), so its excess is parked too.

The horizon is the lane's (`HORIZON_S`). Marketing yields while the transactional lane's committed lag
is over its threshold, and a transactional tenant held back by its own limit pins that offset for as
long as its share lasts: ten seconds of it would count ten seconds of the partition's whole inflow as
lag, and a tenant sending above its own rate would keep every tenant's marketing paused. So the
transactional lane holds one second of a tenant's rate past its burst, about the lag the one-second
offset commit leaves anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field

HORIZON_S = {"transactional": 1.0, "marketing": 10.0}


@dataclass
class BacklogShare:
    horizon_s: float = 10.0
    max_share: int = 5_000
    _last_due: dict[str, float] = field(default_factory=dict)  # what is paced -> the last parked one's due time

    def share(self, rate: float, per_request: int, burst: int = 0, held: bool = False) -> int:
        """Messages a tenant may hold in the worker's buffer. `burst`: what its bucket may still let go at once
        (0 while the tenant waits on its bucket). A tenant whose bucket lets none go within the horizon holds one
        message while its queue is not held (it asks the gate, so a limit raised meanwhile applies) and none while
        it is: held, its message would pin the partition's committed offset while its turn comes (a limit of 5 a
        minute: 12 s, the partition's whole inflow counted as lag meanwhile)."""
        lets_go = burst + int(rate * self.horizon_s)
        if not lets_go:
            return 0 if held else 1
        return max(per_request, min(self.max_share, lets_go))

    def excess(self, queued: int, in_queue: int, rate: float, per_request: int, burst: int = 0,
               held: bool = False) -> int:
        """How many of a queue's `in_queue` messages lie past the tenant's share (`queued`: what the share is
        measured against, this queue or all the tenant's queues for the provider) and might be parked: 0 when
        within it, or when the turn of the first one past it is near anyway, which `park` would never park. A
        queue not held keeps its head, which asks the gate."""
        share = self.share(rate, per_request, burst, held)
        if queued <= share or self._turn(share + 1, rate, burst) < self.horizon_s:
            return 0
        return min(queued - share, in_queue if held else in_queue - 1)

    def park(self, paced: str, queued: int, rate: float, per_request: int, now: float,
             burst: int = 0, held: bool = False) -> float | None:
        """Seconds until a message arriving now is due back, when it should be parked; None when it
        should be queued (the tenant is within its share, or its turn is near anyway). `paced`: whose turns
        these are (the tenant, or a failing endpoint's queue), so what it parked before (`parked`) spaces this
        one out."""
        last = self._last_due.get(paced)
        if last is not None and last <= now:
            del self._last_due[paced]  # nothing of it ahead: not kept for every tenant ever paced
            last = None
        if queued < self.share(rate, per_request, burst, held):
            return None
        wait = self._turn(queued + 1, rate, burst)
        if last is not None:
            wait = max(wait, last - now + 1 / max(rate, 1e-6))  # behind what it parked before
        return None if wait < self.horizon_s else wait

    def parked(self, paced: str, due_at: float) -> None:
        """Record when the message `paced` parked last is due back (one due time kept for it): the next one is
        spaced out from then, so one parked short of its turn (at its max age) holds no turn it will not take."""
        self._last_due[paced] = due_at

    @staticmethod
    def _turn(nth: int, rate: float, burst: int) -> float:
        """Seconds until the tenant's `nth` message in line may go: the burst at once, then `rate` a second."""
        return max(0.0, (nth - burst) / max(rate, 1e-6))
