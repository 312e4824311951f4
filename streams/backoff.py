"""Holding off a dependency that failed: capped exponential backoff with jitter, and one log line
per outage episode (not one per attempt). Pure code; time is passed in.

A role that meets a broker or Redis failure does not crash and does not skip work: it keeps the
work, waits `next_try_at`, and tries again. `failed()` starts or extends an episode, `recovered()`
ends it; the first failure and the recovery are logged, the attempts in between are counted.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

log = logging.getLogger("streams.backoff")


@dataclass
class Outage:
    what: str                     # "redis", "kafka produce", ...: named in the log lines
    base_s: float = 0.25
    cap_s: float = 5.0
    since: float | None = None    # when the episode started (None: not failing)
    attempts: int = 0
    next_try_at: float = 0.0
    rng: random.Random = field(default_factory=random.Random)

    @property
    def active(self) -> bool:
        return self.since is not None

    def ready(self, now: float) -> bool:
        """Whether the dependency may be tried now."""
        return now >= self.next_try_at

    def failed(self, now: float, error: object) -> float:
        """Record a failure; returns when to try next."""
        if self.since is None:
            self.since = now
            log.error("%s unavailable (%s); holding the work and retrying with backoff", self.what, error)
        self.attempts += 1
        delay = min(self.cap_s, self.base_s * 2 ** min(self.attempts - 1, 16))
        self.next_try_at = now + delay * (0.5 + self.rng.random() / 2)
        return self.next_try_at

    def recovered(self, now: float) -> None:
        if self.since is not None:
            log.warning("%s available again after %.1f s (%d attempts)", self.what, now - self.since, self.attempts)
        self.since, self.attempts, self.next_try_at = None, 0, 0.0
