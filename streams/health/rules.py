"""Endpoint health, exactly as the webhook delivery guarantees state it. Pure code; time comes from
the events themselves, so replaying them decides the same way (and names the same alerts).

- Every failed attempt counts (except those that are not the endpoint's: our side failed before sending, or a
  410 came from a URL it no longer has); any
  successful delivery puts the count back to zero.
- At 10 consecutive failures the endpoint is `degraded`: nothing more is sent to it, and it is never
  retried or probed by itself; someone reactivates it once it is fixed.
- Two alerts, to the members of the endpoint's project: "Webhook event dropped" (a delivery was given
  up on, saying why: it used up its 9 attempts, a 410, its max age) and "Webhook delivery stopped" (the
  endpoint just became degraded).
- At most one alert per endpoint per 24 h, with two deliberate exceptions: "stopped" is always sent,
  even after a "dropped" in the window, and so is a delivery dropped on a 410 (the endpoint is disabled
  by it: "gone", once an incident); after a "stopped", "dropped" alerts are silenced for the rest of the
  window. A window that starts more than 5 minutes after an event (a worker's clock ahead) is no window
  for it.
- Reactivation puts the count back to zero and clears the alert state, so a second incident the
  same day gets its own alert.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

from ..outcomes import NOT_ATTEMPTED

DEGRADE_AFTER = 10
# Attempts that are not the endpoint's failure (our side failed before anything was sent: an operator's
# sealing key missing, the worker's endpoint view behind the log; or the URL that answered is no longer the
# endpoint's): they neither degrade it nor mail its tenant's members.
OURS = frozenset({"secret_unreadable", "gone_before_url_change",  # the latter: the old URL answered
                  "endpoint_view_behind",  # the worker's view of the endpoints could not catch up
                  "egress_unavailable",  # no receiver could be reached: our way out is down (webhooks/egress.py)
                  "endpoint_of_another_tenant"})  # an event naming it, written past ingest: never sent
ALERT_WINDOW_MS = 24 * 3600 * 1000
MAX_SKEW_MS = 5 * 60 * 1000  # the workers' clocks, which time the events, may disagree by this much
ALERT_IDS = uuid.UUID("6f1d2c8e-8c3b-4a52-9d2e-5b7f4e1a0c91")  # namespace of alert send ids


@dataclass(frozen=True)
class Health:
    endpoint_id: str
    tenant: str = ""
    consecutive_failures: int = 0
    state: str = "active"            # active | degraded
    last_error: str = ""
    incident: int = 0                # bumped by every reactivation: a new incident, new alerts
    window_start_ms: int | None = None  # when the alert that opened the current 24 h window went out
    stopped_sent: bool = False       # a "stopped" went out in the current window
    gone_sent: bool = False          # a "gone" (a delivery dropped on a 410) went out in this incident
    applied_upto: int = -1           # offset of the last event applied (replays skip what is done)
    applied_partition: int = -1      # ... on this attempts partition (-1: not known, a row written before it was)
    since_ms: int = 0                # when the state last changed
    # The last DEGRADE_AFTER failed attempts counted ("<delivery id>:<n>:<at_ms>"): the same record written twice
    # (its producer got no acknowledgement in time and wrote it again, at a new offset) counts once. An attempt
    # tried again in place (a receiver's short 429) is another record, timed anew: each counts.
    counted_attempts: tuple[str, ...] = ()

    def to_doc(self) -> dict:
        return self.__dict__.copy()

    @classmethod
    def from_doc(cls, doc: dict) -> Health:
        """Fields it does not know are left out: a row written by a newer version (during a rolling deploy, or after
        a rollback) is read, not taken for a malformed event, which dropped every later event of its endpoint."""
        fields = {k: v for k, v in doc.items() if k in _HEALTH_FIELDS}
        if isinstance(fields.get("counted_attempts"), list):  # a JSON list in the row
            fields["counted_attempts"] = tuple(fields["counted_attempts"])
        return cls(**fields)


_HEALTH_FIELDS = frozenset(Health.__dataclass_fields__)


@dataclass(frozen=True)
class Alert:
    kind: str          # "dropped" | "gone" (dropped on a 410, which disabled the endpoint) | "stopped"
    send_id: str       # stable per (endpoint, incident, window): a replay never sends it twice
    at_ms: int
    reason: str = ""   # a "dropped": why the delivery was given up (its dead letter's reason)
    attempts: int = 0  # ... and after how many attempts


@dataclass(frozen=True)
class Outcome:
    health: Health
    state_changed: bool = False
    alerts: tuple[Alert, ...] = ()
    suppressed: tuple[str, ...] = field(default_factory=tuple)  # kinds of alerts held back by the window
    counted: bool = False  # a failed attempt counted against the endpoint (not ours, not held, not another tenant's)


def alert_id(endpoint_id: str, incident: int, kind: str, window_start_ms: int) -> str:
    """Stable per (endpoint, incident, kind, window): the same alert always gets the same send id."""
    return str(uuid.uuid5(ALERT_IDS, f"{endpoint_id}:{incident}:{kind}:{window_start_ms}"))


def window_open(h: Health, now_ms: int) -> bool:
    """An alert window is open at `now_ms`: one that starts well after it (its alert timed by a clock ahead, a
    year ahead say) is none, or it would silence every alert until then."""
    return h.window_start_ms is not None and -MAX_SKEW_MS <= now_ms - h.window_start_ms < ALERT_WINDOW_MS


def reactivation_event(endpoint_id: str, tenant: str, now_ms: int) -> dict:
    """What reactivating an endpoint writes on the attempts topic (key = endpoint id), in line with
    its attempts, so the health app applies it in order."""
    return {"kind": "reactivated", "endpoint_id": endpoint_id, "tenant_id": tenant, "at_ms": now_ms}


def deletion_event(endpoint_id: str, now_ms: int) -> dict:
    """What the health app writes on the attempts topic (key = endpoint id) for an endpoint deleted while it has a
    row: its agent, the only writer of the table, removes the row in line with the endpoint's attempts."""
    return {"kind": "deleted", "endpoint_id": endpoint_id, "at_ms": now_ms}


def state_doc(h: Health) -> dict:
    """What `notif.endpoint.state` says about the endpoint (key = endpoint id)."""
    reason = (f"{DEGRADE_AFTER} consecutive failed attempts; last error: {h.last_error}"
              if h.state == "degraded" else "")
    return {"endpoint_id": h.endpoint_id, "tenant_id": h.tenant, "state": h.state, "reason": reason,
            "since_ms": h.since_ms, "incident": h.incident}


def apply(h: Health, event: dict, offset: int, partition: int = -1) -> Outcome:
    """The health after one event of the endpoint's attempts topic (`offset`: its position there, in `partition`)."""
    if offset <= h.applied_upto and h.applied_partition in (-1, partition):
        # Already applied before a restart: nothing happens twice. Offsets are compared within one partition only:
        # the attempts topic given more partitions moves an endpoint's events to another one, at lower offsets,
        # which were all taken for replays (every later event of the endpoint ignored, reactivations too).
        return Outcome(h)
    if event.get("outcome") == "skipped" or event.get("error") in OURS:
        # Never attempted: neither a failure nor a success.
        return Outcome(replace(h, applied_upto=offset, applied_partition=partition))
    if event.get("held") is True:
        # The receiver asked to wait a few seconds (429, 503 with Retry-After), and the worker tries the same
        # attempt again after that wait: the receiver is there, and a 20 s burst of such answers, ten a
        # delivery, must not degrade it while a failing receiver takes hours on the retry schedule. An
        # attempt that ends throttled (a longer wait, through the retry tiers) still counts.
        return Outcome(replace(h, applied_upto=offset, applied_partition=partition))
    if h.tenant and event.get("tenant_id") and event["tenant_id"] != h.tenant:
        # Another tenant's event naming this endpoint (written to a lane past ingest): it neither counts nor
        # moves the endpoint, nor its alerts, to that tenant.
        return Outcome(replace(h, applied_upto=offset, applied_partition=partition))
    h = replace(h, applied_upto=offset, applied_partition=partition, tenant=event.get("tenant_id") or h.tenant)
    now = int(event.get("at_ms") or 0)
    if event.get("outcome") == NOT_ATTEMPTED:  # given up on before an attempt: its tenant hears of it, no count
        h, alerts, suppressed = _dropped(h, event, now)
        return Outcome(h, False, alerts, suppressed)
    if event.get("kind") == "reactivated":
        reactivated = replace(h, consecutive_failures=0, state="active", window_start_ms=None, stopped_sent=False,
                              gone_sent=False, incident=h.incident + 1, since_ms=now)
        # Published even when this table says active already: the state topic, which the workers and ingest
        # follow, may still say degraded (a changelog recreated or behind it), and a reactivation repairs that.
        return Outcome(reactivated, state_changed=True)
    if event.get("outcome") == "delivered":
        return Outcome(replace(h, consecutive_failures=0))
    attempt = _attempt_key(event)
    if attempt is not None and attempt in h.counted_attempts:
        return Outcome(h)  # a second record of an attempt counted already
    counted = h.counted_attempts if attempt is None else (*h.counted_attempts, attempt)[-DEGRADE_AFTER:]
    h = replace(h, consecutive_failures=h.consecutive_failures + 1, last_error=describe(event),
                counted_attempts=counted)
    h, alerts, suppressed = _dropped(h, event, now)
    if h.state != "active" or h.consecutive_failures < DEGRADE_AFTER:
        return Outcome(h, False, alerts, suppressed, counted=True)
    window = h.window_start_ms if h.window_start_ms is not None and window_open(h, now) else now
    h = replace(h, state="degraded", since_ms=now, window_start_ms=window, stopped_sent=True)
    # Always sent (whatever the window), within the tenant's hourly alert budget (budget.py).
    alerts += (Alert("stopped", alert_id(h.endpoint_id, h.incident, "stopped", window), now),)
    return Outcome(h, True, alerts, suppressed, counted=True)


def _attempt_key(event: dict) -> str | None:
    """Which record of which attempt of which delivery an attempt event is (None: it does not say)."""
    delivery, n, at_ms = event.get("delivery_id"), event.get("n"), event.get("at_ms")
    return f"{delivery}:{n}:{at_ms}" if isinstance(delivery, str) and isinstance(n, int) else None


def _dropped(h: Health, event: dict, now: int) -> tuple[Health, tuple[Alert, ...], tuple[str, ...]]:
    """The alert a delivery given up on (`dropped`, the reason) calls for, or its suppression; none for another."""
    if not event.get("dropped"):
        return h, (), ()
    dropped = event["dropped"]  # why it was given up (events written before the reason was: True)
    reason = dropped if isinstance(dropped, str) else "retries_exhausted"
    attempts = int(event.get("n") or 0)
    if reason == "endpoint_gone" and not h.gone_sent:
        # The endpoint is disabled by it, and nothing more is sent: always said, whatever the window (and
        # within its own hourly budget), as a "stopped" is. It opens a window when none is open.
        window = h.window_start_ms if h.window_start_ms is not None and window_open(h, now) else now
        h = replace(h, window_start_ms=window, gone_sent=True)
        return h, (Alert("gone", alert_id(h.endpoint_id, h.incident, "gone", window), now, reason, attempts),), ()
    if window_open(h, now):
        return h, (), ("dropped",)  # one alert per window; after a "stopped", silence
    h = replace(h, window_start_ms=now, stopped_sent=False)
    return h, (Alert("dropped", alert_id(h.endpoint_id, h.incident, "dropped", now), now, reason, attempts),), ()


def describe(event: dict) -> str:
    """The last error, as the alert names it: the receiver's status, else what went wrong."""
    code, error = event.get("status_code"), event.get("error") or event.get("outcome") or "failed"
    return (f"HTTP {code}" if code else str(error))[:200]


def alert_email(kind: str, endpoint_id: str, endpoint_url: str, tenant: str, last_error: str, members: list[str],
                sender: str, reason: str = "retries_exhausted", attempts: int = 0) -> dict:
    """The rendered email of an alert (sent through our own transactional email lane): it names the
    endpoint (its id and host: a URL's path and query are the tenant's text, and may hold a token),
    the project, the last error and, for a dropped delivery, why it was given up (`reason`, after `attempts`)."""
    host = urlsplit(endpoint_url).hostname or endpoint_url  # "(deleted)" stays as it is
    where = f"Your webhook endpoint at {host} ({endpoint_id}, project {tenant})"
    if kind == "stopped":
        subject = "Webhook delivery stopped"
        text = (f"{where} failed {DEGRADE_AFTER} times in a row and has been marked as degraded: nothing more is "
                f"sent to it, and it is not retried or probed. Last error: {last_error}.\n\n"
                f"Fix the endpoint, then reactivate it (POST /v1/endpoints/{endpoint_id}/reactivate). Events it "
                "missed are listed as skipped in its deliveries and can be replayed for 7 days.")
    else:
        subject = "Webhook event dropped"
        tries = f"{attempts} attempt{'s' if attempts != 1 else ''}" if attempts else "its attempts"
        why = {"retries_exhausted": f"a delivery failed {tries} and was dropped. New events were still being sent "
                                    "when it was dropped",
               "unknown_outcome": f"a delivery was dropped after {tries}: the last one got no answer, so the "
                                  "endpoint may have received it",
               "endpoint_gone": "a delivery was dropped: the endpoint answered 410 Gone, which disables it. Nothing "
                                "more is sent to it until it is reactivated "
                                f"(POST /v1/endpoints/{endpoint_id}/reactivate)",
               "too_old": f"a delivery was dropped after {tries}: its next attempt would have come past the "
                          "delivery's maximum age"}.get(reason, f"a delivery was dropped ({reason}) after {tries}")
        if reason == "too_old" and attempts == 0:  # given up on before its first attempt (not_attempted)
            why = "a delivery was dropped before its first attempt, which would have come past its maximum age"
        text = (f"{where}: {why}. Last error: {last_error}.\n\n"
                "The event can be replayed for 7 days (POST /v1/deliveries/{id}/replay).")
    return {"from": sender, "to": members, "subject": subject, "text": text}
