"""When marketing yields: at once above the threshold, back only below it after a dwell."""

import pytest

from streams.lag.yield_policy import Governor, LagReading, YieldPolicy

P = YieldPolicy(pause_above=100, resume_below=20, min_dwell_s=2.0, stale_after_s=3.0)


def at(g: Governor, lag: int, ms: int) -> bool:
    g.observe(LagReading(lag, 0.0, ms), ms)
    return g.decide(ms)


def test_pauses_at_once_and_resumes_after_hysteresis_and_dwell():
    g = Governor(P)
    assert at(g, 99, 0) is False
    assert at(g, 100, 100) is True           # transactional wins immediately
    assert at(g, 50, 200) is True            # between the thresholds: stay paused
    assert at(g, 10, 1_000) is True          # low enough, but the dwell has not passed
    assert at(g, 10, 2_100) is False         # low enough and dwelt 2 s
    assert at(g, 50, 2_200) is False         # between the thresholds: stay running


def test_seconds_threshold_also_pauses():
    g = Governor(YieldPolicy(pause_above=100, resume_below=20, pause_above_seconds=5.0))
    g.observe(LagReading(3, 6.0, 0), 0)
    assert g.decide(0) is True


def test_the_seconds_threshold_has_a_band_so_marketing_does_not_flap():
    """An oldest transactional message hovering around the seconds threshold (5.1 s, 4.9 s, ...) paused and
    resumed marketing every dwell (each purging its fetch queue); now it resumes at half the threshold."""
    g = Governor(YieldPolicy(pause_above=100, resume_below=20, pause_above_seconds=5.0))
    changes, paused = 0, False
    for i in range(30):
        g.observe(LagReading(3, 5.1 if i % 2 == 0 else 4.9, i * 1_000), i * 1_000)
        now_paused = g.decide(i * 1_000)
        changes, paused = changes + (now_paused != paused), now_paused
    assert changes == 1 and paused
    g.observe(LagReading(3, 2.5, 31_000), 31_000)
    assert g.decide(31_000) is False


def test_a_seconds_band_set_upside_down_is_refused():
    with pytest.raises(ValueError, match="YIELD_RESUME_BELOW_SECONDS"):
        YieldPolicy(pause_above_seconds=5.0, resume_below_seconds=6.0)


def test_stale_reading_is_not_trusted_and_keeps_the_state():
    g = Governor(P)
    assert g.stale(0)                         # no reading at all
    at(g, 500, 0)
    assert g.stale(3_001) and g.decide(3_001) is True  # a stale "high" does not flip to running
    g.observe(LagReading(0, 0.0, 3_500), 3_500)  # a fresh direct reading does
    assert g.decide(3_500) is False


def test_an_older_reading_never_replaces_a_newer_one():
    g = Governor(P)
    g.observe(LagReading(500, 0.0, 2_000), 2_000)
    g.observe(LagReading(0, 0.0, 1_000), 2_000)
    assert g.reading.lag_messages == 500


def test_a_reading_stamped_ahead_of_the_clock_is_refused_and_freezes_nothing():
    """Given a reading of lag 0 stamped far in the future (a monitor whose clock ran ahead, or a stamp in
    microseconds), then a real reading of lag 5,000,
    When the worker decides,
    Then it pauses (before, the future reading was kept as the newest: every later reading was older, it was
    never stale, and marketing never yielded again until the worker restarted)."""
    now = 1_800_000_000_000
    g = Governor(P)
    assert g.observe(LagReading(0, 0.0, now * 1000), now) is False
    assert g.observe(LagReading(0, 0.0, now + 2_000), now) is True  # within the clocks' tolerance
    assert g.observe(LagReading(5_000, 60.0, now + 2_500), now + 2_500) is True
    assert g.decide(now + 2_500) is True


def test_a_reading_stamped_a_little_ahead_ages_from_when_it_was_taken_in():
    """A monitor whose clock runs 2 s ahead and then falls silent: its last reading goes stale 3 s after the worker
    took it in (then the worker reads the lag itself), not 3 s after its stamp."""
    now = 1_800_000_000_000
    g = Governor(P)
    assert g.observe(LagReading(0, 0.0, now + 2_000), now) is True
    assert not g.stale(now + 3_000) and g.stale(now + 3_001)
    assert g.observe(LagReading(7, 0.0, now + 1_000), now + 1_000) and g.reading.lag_messages == 7  # newer: taken


def test_a_clock_stepped_back_does_not_freeze_the_decision_on_the_last_reading():
    """Given a worker whose clock ran 60 s fast, holding a reading of lag 0 stamped by that clock,
    When its clock is stepped back 60 s (NTP) and a reading of lag 5,000 arrives stamped by the corrected clock,
    Then the worker pauses marketing at once, and until such a reading arrives it does not trust the kept one and
    asks for a direct reading (before: every reading looked older than the kept one and was dropped, the kept one never went stale, and
    marketing went on sending for the 60 s)."""
    fast = 1_800_000_060_000
    g = Governor(P)
    assert at(g, 0, fast) is False
    corrected = fast - 60_000
    assert g.aging(corrected) and g.stale(corrected)  # the kept reading's age is unknown: read the lag directly
    assert g.observe(LagReading(5_000, 0.0, corrected), corrected)
    assert g.decide(corrected) is True and g.reading.lag_messages == 5_000


def test_a_clock_stepped_back_while_marketing_yields_delays_its_resume_by_one_dwell_not_by_the_step():
    """Given marketing paused by a lag of 5,000 at a moment T,
    When this host's clock is stepped back an hour (NTP) and the lag falls to 0 in readings stamped by that clock,
    Then marketing resumes one dwell (2 s) after the step, not an hour later (before: the time since the pause
    read as negative until the clock caught up with T, and marketing sent nothing for the hour)."""
    g = Governor(P)
    paused_at = 1_800_000_000_000
    assert at(g, 5_000, paused_at) is True
    stepped = paused_at - 3_600_000
    assert at(g, 0, stepped) is True                  # the dwell starts again from the step
    assert at(g, 0, stepped + 2_100) is False         # and ends one dwell later


def test_thresholds_must_leave_a_gap():
    with pytest.raises(ValueError, match="must be below"):
        YieldPolicy(pause_above=10, resume_below=10)


@pytest.mark.parametrize("setting, named", [
    ({"stale_after_s": 0.0}, "YIELD_STALE_AFTER_S"), ({"stale_after_s": float("nan")}, "YIELD_STALE_AFTER_S"),
    ({"stale_after_s": float("inf")}, "YIELD_STALE_AFTER_S"), ({"stale_after_s": 3000.0}, "YIELD_STALE_AFTER_S"),
    ({"min_dwell_s": -1.0}, "YIELD_MIN_DWELL_S"), ({"min_dwell_s": float("nan")}, "YIELD_MIN_DWELL_S"),
    ({"min_dwell_s": 2000.0}, "YIELD_MIN_DWELL_S"), ({"pause_above_seconds": -5.0}, "YIELD_PAUSE_ABOVE_SECONDS"),
    ({"resume_below_seconds": 5.0}, "YIELD_RESUME_BELOW_SECONDS .* while YIELD_PAUSE_ABOVE_SECONDS is 0"),
    ({"pause_above_seconds": 10.0, "resume_below_seconds": 10.0}, "YIELD_RESUME_BELOW_SECONDS .* below"),
])
def test_a_stale_age_a_dwell_or_a_threshold_that_cannot_work_is_refused_naming_its_variable(setting, named):
    """0 would make every reading stale before the monitor's next one; NaN would never let one go stale, and 3000
    (meant as ms) would trust a dead monitor's last reading for 50 minutes; a negative or NaN dwell has no meaning,
    and 2000 s would hold every pause half an hour; a negative age threshold read as the message count's error
    (`resume_below_seconds (None)`); a resume age without an age threshold was ignored without a word."""
    with pytest.raises(ValueError, match=named):
        YieldPolicy(**setting)

