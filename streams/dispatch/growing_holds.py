"""Holds of a queue for a reason of its own (its tenant's provider key refused, no limit or key set for it): twice
as long each time the reason is met again after the last hold ended, up to LONG_HOLD_MAX_S, so a reason left
uncured costs a request (and a parked copy) per doubling hold, not one every 30 s.

Met again while its hold runs (the other requests of the same round, answered alike), it is the same incident:
it counts once. Forgotten once a request of the queue goes through (`clear`), or long after its last hold ended.
"""

from __future__ import annotations

LONG_HOLD_MAX_S = 900.0
FORGET_AFTER_S = 2 * LONG_HOLD_MAX_S  # past the end of its last hold: the next incident starts at the first hold


def growing_hold(first_s: float, times: int) -> float:
    """The hold of a queue held for the same reason `times` times in a row: doubling, at most LONG_HOLD_MAX_S."""
    return min(first_s * 2 ** min(times - 1, 16), max(first_s, LONG_HOLD_MAX_S))


class GrowingHolds:
    def __init__(self) -> None:
        self._held: dict[str, tuple[int, float]] = {}  # queue -> (holds in a row, end of the last, monotonic)

    def hold_for(self, queue: str, first_s: float, now: float) -> float:
        """Seconds to hold `queue` from `now` on meeting its reason again."""
        times, until = self._held.get(queue, (0, 0.0))
        if now < until:
            return until - now  # the hold already running: the same incident
        if now > until + FORGET_AFTER_S:
            times = 0
            self._forget_old(now)
        wait = growing_hold(first_s, times + 1)
        self._held[queue] = (times + 1, now + wait)
        return wait

    def clear(self, queue: str) -> None:
        if self._held:
            self._held.pop(queue, None)

    def _forget_old(self, now: float) -> None:
        """Queues met long ago and never since (a tenant gone, its sends expired, a partition revoked)."""
        for queue in [q for q, (_, until) in self._held.items() if now > until + FORGET_AFTER_S]:
            del self._held[queue]

    def __len__(self) -> int:
        return len(self._held)
