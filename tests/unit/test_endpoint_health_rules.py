"""Endpoint health rules (streams.health.rules), exactly as the webhook delivery guarantees state
them: the counter, degradation at 10, the two alerts and their 24 h dedupe, reactivation, and
replays after a restart. Pure: events are dicts, time comes from the events."""

import dataclasses

import pytest

from streams.health.rules import ALERT_WINDOW_MS, DEGRADE_AFTER, Health, apply, reactivation_event, state_doc
from streams.webhooks.fanout import BacklogLimit, skip_reason
from streams.webhooks.model import Endpoint, with_health
from streams.webhooks.model import Health as EndpointHealth

HOUR = 3600 * 1000


class Feed:
    """One endpoint's attempts topic: events get increasing offsets; the health is carried along."""

    def __init__(self):
        self.h, self.offset, self.alerts, self.suppressed = Health("ep_1"), -1, [], []

    def push(self, event: dict, at_ms: int):
        self.offset += 1
        out = apply(self.h, {"tenant_id": "acme", "at_ms": at_ms, **event}, self.offset)
        self.h = out.health
        self.alerts += [(a.kind, a.send_id) for a in out.alerts]
        self.suppressed += list(out.suppressed)
        return out

    def fail(self, at_ms: int, dropped: bool = False):
        return self.push({"kind": "attempt", "outcome": "unavailable", "status_code": 500, "dropped": dropped}, at_ms)

    def ok(self, at_ms: int):
        return self.push({"kind": "attempt", "outcome": "delivered", "status_code": 200}, at_ms)


def test_a_success_resets_the_count_and_the_tenth_consecutive_failure_degrades():
    """Given 9 failures, a success, then 9 failures,
    When one more attempt fails,
    Then the endpoint stays active until exactly that tenth consecutive failure, which degrades it and
    sends one "stopped" alert naming the last error."""
    f = Feed()
    for t in range(9):
        f.fail(t)
    f.ok(9)
    assert f.h.consecutive_failures == 0
    for t in range(10, 19):
        assert not f.fail(t).state_changed
    assert f.h.state == "active" and f.h.consecutive_failures == DEGRADE_AFTER - 1
    out = f.fail(19)
    assert out.state_changed and f.h.state == "degraded" and [k for k, _ in f.alerts] == ["stopped"]
    assert "HTTP 500" in state_doc(f.h)["reason"]


def test_skipped_deliveries_count_neither_way():
    f = Feed()
    f.fail(0)
    f.push({"kind": "attempt", "outcome": "skipped"}, 1)
    assert f.h.consecutive_failures == 1


@pytest.mark.parametrize("ours", ["secret_unreadable", "gone_before_url_change", "endpoint_of_another_tenant",
                                  "egress_unavailable"])
def test_attempts_that_failed_on_our_side_never_degrade_the_endpoint_nor_mail_its_tenant(ours):
    """Given 9 failures of the receiver,
    When 20 attempts fail before sending because the worker cannot open the endpoint's signing secret (an
    operator's key missing), or answered 410 from a URL the endpoint no longer has, the last of them dropping
    its delivery,
    Then the endpoint stays active, the count stays at 9 and no alert goes to the tenant's members."""
    f = Feed()
    for t in range(9):
        f.fail(t)
    for t in range(9, 29):
        f.push({"kind": "attempt", "outcome": "unavailable", "error": ours, "dropped": t == 28}, t)
    assert (f.h.state, f.h.consecutive_failures, f.alerts) == ("active", 9, [])


def test_another_tenants_events_naming_the_endpoint_neither_degrade_it_nor_take_its_alerts():
    """Given an endpoint of acme's whose first events are globex's, written to a lane past ingest naming acme's
    endpoint (the worker refuses to send them: `endpoint_of_another_tenant`),
    When acme's own receiver then fails 10 times, with more events of globex's in between (an older worker's, say,
    that sent them),
    Then globex's events change nothing (before: the first one made the endpoint globex's, so acme's alerts would
    go to globex's members, and every one counted as a failure), and acme's tenth failure degrades it with one
    "stopped" alert, for acme."""
    f = Feed()
    forged = {"kind": "attempt", "tenant_id": "globex", "outcome": "rejected", "error": "endpoint_of_another_tenant"}
    for t in range(20):
        f.push(forged, t)
    assert (f.h.tenant, f.h.consecutive_failures) == ("", 0)
    f.fail(20)
    for t in range(21, 30):
        f.push({"kind": "attempt", "tenant_id": "globex", "outcome": "unavailable", "status_code": 500}, t)
        assert f.h.consecutive_failures == t - 20
        f.fail(t)
    assert (f.h.tenant, f.h.state, [k for k, _ in f.alerts]) == ("acme", "degraded", ["stopped"])


def test_dropped_then_stopped_sends_both():
    """Given a delivery dropped after 9 failed attempts (a "dropped" alert opens the 24 h window),
    When the next attempt fails (the tenth in a row),
    Then "stopped" is sent as well: the message that says we stopped is never the one left out."""
    f = Feed()
    for t in range(8):
        f.fail(t)
    f.fail(8, dropped=True)
    f.fail(9)
    assert [k for k, _ in f.alerts] == ["dropped", "stopped"]


def test_after_stopped_dropped_alerts_are_silenced_for_the_rest_of_the_window():
    """Given a degraded endpoint whose "stopped" went out,
    When deliveries are dropped 1 h and 23 h later,
    Then no "dropped" alert goes out (both suppressed); 25 h later the window is over and one would."""
    f = Feed()
    for t in range(10):
        f.fail(t)
    f.fail(1 * HOUR, dropped=True)
    f.fail(23 * HOUR, dropped=True)
    assert [k for k, _ in f.alerts] == ["stopped"] and f.suppressed == ["dropped", "dropped"]
    f.fail(10 + ALERT_WINDOW_MS, dropped=True)
    assert [k for k, _ in f.alerts] == ["stopped", "dropped"]


def test_at_most_one_dropped_alert_per_window():
    f = Feed()
    f.fail(0, dropped=True)
    f.ok(1)
    f.fail(2 * HOUR, dropped=True)
    assert [k for k, _ in f.alerts] == ["dropped"] and f.suppressed == ["dropped"]


def test_reactivation_resets_the_counter_and_clears_the_alert_state():
    """Given an endpoint degraded (stopped sent), then reactivated,
    When it fails 10 times again the same day,
    Then it degrades again and the second incident gets its own "stopped" alert (a different send id)."""
    f = Feed()
    for t in range(10):
        f.fail(t)
    out = f.push(reactivation_event("ep_1", "acme", 100), 100)
    assert out.state_changed and f.h.state == "active" and f.h.consecutive_failures == 0
    for t in range(101, 111):
        f.fail(t)
    assert [k for k, _ in f.alerts] == ["stopped", "stopped"] and f.alerts[0][1] != f.alerts[1][1]


def test_a_receiver_asking_to_wait_a_few_seconds_is_not_degraded_for_it():
    """Given an endpoint whose receiver answers 429 with Retry-After: 2 through a burst, each answer an attempt
    event the worker tries again after the wait (`held`), 30 of them,
    When they are applied,
    Then it stays active with no failure counted and no alert (before: the tenth degraded it in some 20 s, while a
    receiver answering 500 takes hours on the retry schedule); 10 throttled attempts that each went to a retry
    tier (not held) still degrade it."""
    f = Feed()
    for t in range(30):
        f.push({"kind": "attempt", "outcome": "throttled", "status_code": 429, "dropped": False, "held": True}, t)
    assert (f.h.state, f.h.consecutive_failures, f.alerts) == ("active", 0, [])
    for t in range(30, 40):
        f.push({"kind": "attempt", "outcome": "throttled", "status_code": 429, "dropped": False, "held": False}, t)
    assert f.h.state == "degraded" and [k for k, _ in f.alerts] == ["stopped"]


def test_a_reactivation_publishes_the_state_even_when_the_table_says_active_already():
    """Given an endpoint this table holds active (the state topic, which workers and ingest follow, may still say
    degraded: a changelog recreated, or behind the state topic),
    When it is reactivated,
    Then the reactivation publishes its state (before: nothing was published, the endpoint stayed degraded
    everywhere else for good and every new event was skipped, while the API answered that it was reactivated)."""
    out = apply(Health("ep_1", tenant="acme"), reactivation_event("ep_1", "acme", 100), 5)
    assert out.state_changed and out.health.state == "active" and state_doc(out.health)["state"] == "active"


def test_an_event_applied_before_a_restart_changes_nothing_when_read_again():
    """Given the tenth failure applied (stopped alert, degraded) at offset 9,
    When the app restarts and reads offset 9 again (its commit came after),
    Then nothing happens: no second alert, no second state change."""
    f = Feed()
    for t in range(10):
        f.fail(t)
    again = apply(f.h, {"kind": "attempt", "outcome": "unavailable", "at_ms": 9}, 9)
    assert again.health is f.h and again.alerts == () and not again.state_changed


def test_offsets_are_compared_within_one_attempts_partition():
    """Given an endpoint whose events were applied up to offset 900 of attempts partition 0,
    When the attempts topic is given more partitions (an operator's change) and its next events, a failure and then a
    reactivation, come on partition 3 at offsets 5 and 6, and offset 6 is read again (a restart),
    Then both are applied (before: taken for replays, being below 900, so the endpoint stayed degraded whatever its
    tenant did), the read again is not; a row written before partitions were remembered (-1) compares as before."""
    h = Health("ep_1", tenant="acme", state="degraded", applied_upto=900, applied_partition=0)
    failed = apply(h, {"tenant_id": "acme", "kind": "attempt", "outcome": "unavailable", "at_ms": 1}, 5, partition=3)
    assert failed.counted and failed.health.consecutive_failures == 1
    back = apply(failed.health, reactivation_event("ep_1", "acme", 2), 6, partition=3)
    assert back.state_changed and back.health.state == "active"
    assert (back.health.applied_upto, back.health.applied_partition) == (6, 3)
    assert apply(back.health, reactivation_event("ep_1", "acme", 2), 6, partition=3).health is back.health
    legacy = Health("ep_1", tenant="acme", applied_upto=900)
    assert apply(legacy, reactivation_event("ep_1", "acme", 2), 5, partition=3).health is legacy


def test_an_alert_sent_again_keeps_its_send_id():
    """Given the tenth failure applied from a row that was never written (the app died after the alert
    went out, before the row was saved),
    When the same event is applied again from the previous row,
    Then the alert has the same send id, so dispatch delivers it once."""
    f = Feed()
    for t in range(9):
        f.fail(t)
    before = f.h
    first = f.fail(9)
    second = apply(before, {"tenant_id": "acme", "kind": "attempt", "outcome": "unavailable", "status_code": 500,
                            "at_ms": 9}, 9)
    assert [a.send_id for a in first.alerts] == [a.send_id for a in second.alerts]


def test_state_survives_its_document_round_trip():
    f = Feed()
    for t in range(10):
        f.fail(t)
    assert Health.from_doc(f.h.to_doc()) == f.h


def test_degraded_health_shows_on_the_endpoint_but_a_disabled_one_stays_disabled():
    ep = Endpoint("ep_1", "acme", "https://x.example/h", ("*",))
    degraded = EndpointHealth("degraded", "10 consecutive failed attempts", 5)
    assert with_health(ep, degraded).state == "degraded"
    assert with_health(ep, None) is ep
    gone = Endpoint("ep_1", "acme", "https://x.example/h", ("*",), state="disabled")
    assert with_health(gone, degraded).state == "disabled"


def test_new_events_are_skipped_for_a_degraded_endpoint_or_an_extreme_backlog():
    """A degraded endpoint's new deliveries are skipped; so are those of an endpoint holding at least the count of
    undelivered deliveries each at least the age old (fewer is not: the fresh ones do not count)."""
    limit = BacklogLimit(max_count=100, max_age_ms=HOUR)
    now = 10 * HOUR
    assert limit.overdue_before_ms(now) == 9 * HOUR
    assert skip_reason(EndpointHealth("degraded"), 0, limit) == "endpoint_degraded"
    assert skip_reason(None, 100, limit) == "backlog_shed"
    assert skip_reason(None, 99, limit) is None
    assert skip_reason(EndpointHealth("active"), 0, limit) is None
    # Disabled by a 410 Gone: recorded skipped (replayable once reactivated), whatever its health says.
    assert skip_reason(EndpointHealth("active"), 0, limit, disabled=True) == "endpoint_disabled"


@pytest.mark.parametrize("reason, attempt, says, never", [
    ("retries_exhausted", 9, "a delivery failed 9 attempts and was dropped", "410"),
    ("endpoint_gone", 1, "answered 410 Gone, which disables it", "failed 9 attempts"),
    ("unknown_outcome", 9, "the endpoint may have received it", "failed 9 attempts"),
    ("too_old", 4, "past the delivery's maximum age", "failed 9 attempts"),
    (True, 9, "a delivery failed 9 attempts", "410"),  # an event written before the reason was
])
def test_a_dropped_alert_says_why_the_delivery_was_given_up(reason, attempt, says, never):
    """Given a delivery given up on at its `attempt`-th attempt for `reason`,
    When its attempt event is applied,
    Then the "dropped" alert's email says why (before: every one said it "failed 9 attempts", a 410 at the first
    attempt included)."""
    from streams.health.rules import alert_email

    f = Feed()
    out = f.push({"kind": "attempt", "outcome": "gone" if reason == "endpoint_gone" else "unavailable",
                  "status_code": 410 if reason == "endpoint_gone" else 500, "n": attempt, "dropped": reason}, 0)
    [alert] = out.alerts
    text = alert_email(alert.kind, "ep_1", "https://hooks.acme.test/x", "acme", f.h.last_error, ["m@acme.test"],
                       "alerts@platform.test", alert.reason, alert.attempts)["text"]
    assert says in text and never not in text


def test_a_delivery_dropped_on_a_410_is_said_whatever_the_window_once_an_incident():
    """Given an endpoint whose delivery was dropped (attempts used up, an alert opening the 24 h window) at 09:00,
    When at 12:00 its receiver answers 410, which disables it, and another 410 follows,
    Then the 410 is mailed (kind `gone`), once (before: suppressed by the window, the tenant's last word being
    that events were still being sent, and the endpoint disabled unsaid); after a reactivation, a 410 is mailed
    again."""
    f = Feed()
    f.fail(9 * HOUR, dropped=True)
    for at in (12 * HOUR, 12 * HOUR + 1):
        f.push({"kind": "attempt", "outcome": "gone", "status_code": 410, "dropped": "endpoint_gone"}, at)
    assert [kind for kind, _ in f.alerts] == ["dropped", "gone"] and f.suppressed == ["dropped"]
    f.push(reactivation_event("ep_1", "acme", 13 * HOUR), 13 * HOUR)
    f.push({"kind": "attempt", "outcome": "gone", "status_code": 410, "dropped": "endpoint_gone"}, 14 * HOUR)
    assert [kind for kind, _ in f.alerts] == ["dropped", "gone", "gone"] and len(set(f.alerts)) == 3


def test_a_window_timed_by_a_clock_far_ahead_does_not_silence_later_drops():
    """Given an endpoint whose first dropped delivery was timed by a worker whose clock was a year ahead,
    When deliveries are dropped two and ten days later by workers with right clocks,
    Then each opens its own window and is mailed (before: now minus a window starting a year ahead was negative,
    always "open": every drop was suppressed until a reactivation)."""
    f = Feed()
    f.fail(365 * 24 * HOUR, dropped=True)
    f.fail(2 * 24 * HOUR, dropped=True)
    f.fail(10 * 24 * HOUR, dropped=True)
    assert [kind for kind, _ in f.alerts] == ["dropped"] * 3 and f.suppressed == []


def test_only_an_attempt_counted_against_the_endpoint_is_counted_in_the_failures_histogram():
    """Given an endpoint's attempts: one failing with an error of ours (its secret unreadable), one held (a short
    Retry-After), one of another tenant naming it, one delivered, one failed (500), and its tenth failure,
    When each is applied,
    Then only the 500 and the tenth failure say they were counted (the health app observes the consecutive-failures
    histogram for those alone; before, every event without a delivered outcome was observed, and an incident of
    ours filled the panel with attempts the rules set aside)."""
    feed = Feed()
    feed.h = dataclasses.replace(feed.h, tenant="acme")  # the endpoint's own tenant, as the directory says
    counted = [feed.push({"kind": "attempt", "outcome": "unavailable", "error": "secret_unreadable"}, 1).counted,
               feed.push({"kind": "attempt", "outcome": "throttled", "status_code": 429, "held": True}, 2).counted,
               feed.push({"kind": "attempt", "outcome": "unavailable", "status_code": 500,
                          "tenant_id": "globex"}, 3).counted,
               feed.ok(4).counted, feed.fail(5).counted]
    assert counted == [False, False, False, False, True]
    for at in range(6, 6 + DEGRADE_AFTER - 2):
        feed.fail(at)
    tenth = feed.fail(100)
    assert tenth.state_changed and tenth.counted


def test_a_row_written_by_a_newer_version_is_read_and_its_endpoint_still_degrades():
    """Given an endpoint's row as a newer version writes it (a field this version does not know), 9 failures in,
    When this version reads it (a rolling deploy, a rollback) and applies the tenth failure,
    Then the endpoint is degraded (before: the row raised TypeError, every later event of the endpoint was
    ignored as malformed, and it never degraded nor was reactivated)."""
    feed = Feed()
    for i in range(DEGRADE_AFTER - 1):
        feed.fail(i * 1000)
    row = {**feed.h.to_doc(), "a_field_from_a_newer_version": 1}

    feed.h = Health.from_doc(row)
    assert feed.fail(DEGRADE_AFTER * 1000).health.state == "degraded"


def test_a_delivery_dropped_before_an_attempt_mails_the_tenant_but_counts_no_failure():
    """Given an endpoint with 3 failures in a row,
    When a delivery is dropped before an attempt (past its max age) and, an hour later, another,
    Then the first sends "Webhook event dropped" (reason too_old, after its 5 attempts) and the second is
    suppressed (one per 24 h), and the endpoint's count stays at 3 (no attempt reached it); one dropped before its
    first attempt says so."""
    feed = Feed()
    for i in range(3):
        feed.fail(i * 1000)
    unattempted = {"kind": "attempt", "outcome": "not_attempted", "error": "too_old", "dropped": "too_old", "n": 5}

    out = feed.push(unattempted, 10_000)
    assert [(a.kind, a.reason, a.attempts) for a in out.alerts] == [("dropped", "too_old", 5)]
    feed.push(unattempted, 10_000 + HOUR)
    assert feed.suppressed == ["dropped"]
    assert (feed.h.consecutive_failures, feed.h.state) == (3, "active")
    from streams.health.rules import alert_email

    text = alert_email("dropped", "ep_1", "https://hooks.acme.test/x", "acme", "HTTP 500", ["m@acme.test"],
                       "alerts@dispatch.test", "too_old", 0)["text"]
    assert "dropped before its first attempt, which would have come past its maximum age" in text


def _failed(delivery: str, n: int, **more) -> dict:
    return {"kind": "attempt", "delivery_id": delivery, "n": n, "outcome": "unavailable", "status_code": 500, **more}


def test_an_attempt_whose_record_was_written_twice_counts_once():
    """Given an endpoint whose failed attempts' records are each written twice at successive offsets (a worker got no
    acknowledgement in time, a broker failover, and wrote the record again), one of them after a success,
    When the health app applies them all (and its row is saved and read back between them),
    Then each attempt counts once: degraded at the tenth attempt, not the fifth, with one "stopped" alert (before:
    the second record counted as a failure of its own)."""
    f = Feed()
    for n in range(1, 10):
        for _ in range(2):
            f.push(_failed(f"d-{n}", 1, at_ms=n), n)
        f.h = Health.from_doc(f.h.to_doc())
    assert (f.h.state, f.h.consecutive_failures) == ("active", 9)
    f.ok(10)
    f.push(_failed("d-9", 1, at_ms=9), 11)  # a record of before the success, written again after it
    assert f.h.consecutive_failures == 0
    for n in range(1, 10):
        f.push(_failed(f"e-{n}", 1, at_ms=20 + n), 20 + n)
    f.push(_failed("e-10", 1, at_ms=30), 30)
    assert (f.h.state, [k for k, _ in f.alerts]) == ("degraded", ["stopped"])


def test_an_attempt_tried_again_in_place_counts_each_time_and_its_drop_is_said():
    """Given a delivery's attempt 3 that its receiver keeps answering 429 past the first minute (the worker tries
    the same attempt again in place, each answer a record of its own, timed anew, not held),
    When ten such answers are applied; or three, then the attempt is given up on (dropped),
    Then each answer counts (degraded at the tenth), and the drop is applied and said (before the records were told
    apart by their time, the nine after the first were taken for copies of it)."""
    f = Feed()
    for t in range(10):
        f.push(_failed("d-1", 3, outcome="throttled", status_code=429, held=False, at_ms=t), t)
    assert (f.h.state, f.h.consecutive_failures) == ("degraded", 10)
    g = Feed()
    for t in range(3):
        g.push(_failed("d-1", 3, outcome="throttled", status_code=429, held=False, at_ms=t), t)
    out = g.push(_failed("d-1", 3, dropped="retries_exhausted", at_ms=3), 3)
    assert out.counted and g.h.consecutive_failures == 4 and [k for k, _ in g.alerts] == ["dropped"]
