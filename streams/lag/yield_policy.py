"""When marketing yields to transactional traffic. Pure code; time is passed in.

Pause at once when the transactional lag reaches `pause_above` (transactional always wins);
resume only when it has fallen to `resume_below` *and* the pause has lasted `min_dwell_s`
(hysteresis and dwell: pause/resume purges the fetch queue, so flapping is expensive).
A reading older than `stale_after_s` is not trusted: the caller must read the lag directly
(`needs_direct_read`); it is never silently taken as zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

# A reading may not go stale sooner: the lag monitor publishes at least every 0.5 s (`monitor.MAX_INTERVAL_S`),
# and a reading stale before the next one arrives would leave marketing reading the lag itself all the time.
MIN_STALE_AFTER_S = 1.0
# Nor later: a dead monitor's last reading (often 0) would be trusted that long (3000, meant as ms, is 50 minutes of
# marketing sending while OTPs wait). And no pause is meant to last longer than a few minutes for want of a reading.
MAX_STALE_AFTER_S = 60.0
MAX_MIN_DWELL_S = 300.0


@dataclass(frozen=True)
class LagReading:
    lag_messages: int
    lag_seconds: float
    ts_ms: int            # when the lag was measured
    source: str = "monitor"


@dataclass(frozen=True)
class YieldPolicy:
    pause_above: int = 100
    resume_below: int = 20
    pause_above_seconds: float = 0.0   # 0: only the message count decides
    resume_below_seconds: float | None = None  # None: half of pause_above_seconds
    min_dwell_s: float = 2.0
    stale_after_s: float = 3.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.stale_after_s) and MIN_STALE_AFTER_S <= self.stale_after_s <= MAX_STALE_AFTER_S):
            raise ValueError(f"YIELD_STALE_AFTER_S ({self.stale_after_s}) must be a number of seconds from "
                             f"{MIN_STALE_AFTER_S:g} to {MAX_STALE_AFTER_S:g}")
        if not (math.isfinite(self.min_dwell_s) and 0 <= self.min_dwell_s <= MAX_MIN_DWELL_S):
            raise ValueError(f"YIELD_MIN_DWELL_S ({self.min_dwell_s}) must be a number of seconds from 0 to "
                             f"{MAX_MIN_DWELL_S:g}")
        if not 0 <= self.resume_below < self.pause_above:
            raise ValueError(f"YIELD_RESUME_BELOW ({self.resume_below}) must be below "
                             f"YIELD_PAUSE_ABOVE ({self.pause_above}) and at least 0")
        if not (math.isfinite(self.pause_above_seconds) and self.pause_above_seconds >= 0):
            raise ValueError(f"YIELD_PAUSE_ABOVE_SECONDS ({self.pause_above_seconds}) must be a number of seconds, "
                             "at least 0 (0: off)")
        if not self.pause_above_seconds and self.resume_below_seconds is not None:
            raise ValueError(f"YIELD_RESUME_BELOW_SECONDS ({self.resume_below_seconds}) is set while "
                             "YIELD_PAUSE_ABOVE_SECONDS is 0 (off): it would be ignored")
        if self.pause_above_seconds and not 0 <= self.resume_seconds < self.pause_above_seconds:
            raise ValueError(f"YIELD_RESUME_BELOW_SECONDS ({self.resume_below_seconds}) must be below "
                             f"YIELD_PAUSE_ABOVE_SECONDS ({self.pause_above_seconds}) and at least 0")

    @property
    def resume_seconds(self) -> float:
        """The age of the oldest transactional message at or below which marketing may resume (the seconds
        threshold has a band like the count's: resuming just below where it paused, it flapped)."""
        if self.resume_below_seconds is not None:
            return self.resume_below_seconds
        return self.pause_above_seconds / 2


class Governor:
    def __init__(self, policy: YieldPolicy):
        self.policy = policy
        self.paused = False
        self.changed_at = float("-inf")
        self.reading: LagReading | None = None

    def stale(self, now_ms: int) -> bool:
        """No reading, one too old, or one stamped ahead of now (this host's clock stepped back since: its age is
        unknown, and trusting it for the size of the step could let marketing send through a transactional peak)."""
        return (self.reading is None or self.reading.ts_ms > now_ms
                or now_ms - self.reading.ts_ms > self.policy.stale_after_s * 1000)

    def aging(self, now_ms: int) -> bool:
        """Past half the age a reading may have: time to measure the lag directly, so that a silent monitor's
        last reading is followed by a direct one before it goes stale (not after: the lane would stop meanwhile)."""
        # A reading stamped ahead of now (this host's clock stepped back since) has an age nobody knows: read again.
        return (self.reading is None or self.reading.ts_ms > now_ms
                or now_ms - self.reading.ts_ms > self.policy.stale_after_s * 500)

    def observe(self, reading: LagReading, now_ms: int) -> bool:
        """Keep the newest reading. One stamped further ahead of `now_ms` than a reading may age is refused
        (False): a monitor whose clock ran ahead, or a stamp in other units, would otherwise be newer than every
        later reading and never stale, and the decision would freeze on it. One stamped ahead by less counts as
        measured now: it ages from now, not from its stamp (a silent monitor's last reading would otherwise stay
        fresh for up to `stale_after_s` longer)."""
        if reading.ts_ms - now_ms > self.policy.stale_after_s * 1000:
            return False
        if reading.ts_ms > now_ms:
            reading = replace(reading, ts_ms=now_ms)
        # The kept reading stamped ahead of now: this host's clock stepped back (NTP correcting a fast clock), and
        # every later reading would look older than it; any reading replaces it, or the decision would freeze.
        if self.reading is None or reading.ts_ms >= self.reading.ts_ms or self.reading.ts_ms > now_ms:
            self.reading = reading
        return True

    def decide(self, now_ms: int) -> bool:
        """The paused state to hold now. With no trustworthy reading the state is kept as is
        (the caller reads the lag directly before that matters)."""
        r = self.reading
        if r is None or self.stale(now_ms):
            return self.paused
        p = self.policy
        if now_ms < self.changed_at:
            # This host's clock stepped back past the last change: the time since is unknown. The dwell starts
            # again from now (at most one more dwell), instead of lasting the size of the step (an hour's step:
            # marketing paused for an hour).
            self.changed_at = now_ms
        over = r.lag_messages >= p.pause_above or (p.pause_above_seconds and r.lag_seconds >= p.pause_above_seconds)
        if not self.paused and over:
            self._set(True, now_ms)
        elif self.paused and r.lag_messages <= p.resume_below and not over \
                and (not p.pause_above_seconds or r.lag_seconds <= p.resume_seconds) \
                and now_ms - self.changed_at >= p.min_dwell_s * 1000:
            self._set(False, now_ms)
        return self.paused

    def _set(self, paused: bool, now_ms: int) -> None:
        self.paused = paused
        self.changed_at = now_ms
