"""The outcome event: one per attempt and per final outcome of a send, on `notif.outcomes`. The
status store, replays and `streams state recover` read it. Pure code.

A record holds one event (key = its send id), or the `delivered` events of one provider request
together, `{"events": [...]}` (key = the request's idempotency key; at most OUTCOMES_PER_RECORD
each): a worker writes, and waits for the broker to acknowledge, one record per request instead of
one per send. Readers take the events of a record with `events_of`; each event means the same
either way.

Statuses: `accepted` (published by the SDK; the ingest API writes it to the status store itself),
`retrying` and `unknown` (intermediate), `delivered`, `dead_lettered`, `dropped` (a webhook delivery
given up) and `skipped` (a webhook delivery never attempted) (final). An `accepted` event never
replaces any other status.
"""

from __future__ import annotations

from typing import Any

from .send import Send

OUTCOMES_PER_RECORD = 100
OUTCOME_RECORD_BYTES = 512 * 1024  # and about this many bytes (notif.outcomes takes the broker's 1 MiB default)
ACCEPTED = "accepted"
NOT_ATTEMPTED = "not_attempted"  # a webhook attempt event's outcome: given up on before an attempt (it says why)


def outcome_event(s: Send, status: str, attempts: int | None, now_ms: int, provider: str,
                  provider_message_id: str = "", reason: str = "", attempt: dict | None = None) -> dict:
    """`attempt`: the attempt that led here (its number, time, status code, outcome, duration)."""
    return {"send_id": s.send_id, "tenant_id": s.tenant_id, "channel": s.channel, "lane": s.lane,
            "status": status, "attempts": attempts, "provider": provider,
            "provider_message_id": provider_message_id, "reason": reason,
            "created_at_ms": s.created_at_ms, "completed_at_ms": now_ms,
            "latency_ms": max(0, now_ms - s.created_at_ms), "attempt": attempt, "replay_of": s.replay_of,
            **webhook_fields(s)}


def accepted_events(sends: list[Send], now_ms: int) -> list[dict]:
    """Sends the broker has now, their status until their first outcome (a webhook delivery's names its endpoint:
    it is listed there, and found, while it waits its turn)."""
    return [{"send_id": s.send_id, "tenant_id": s.tenant_id, "channel": s.channel, "lane": s.lane,
             "status": ACCEPTED, "created_at_ms": s.created_at_ms, "accepted_at_ms": now_ms, "replay_of": s.replay_of,
             **webhook_fields(s)} for s in sends]


def attempt_event(s: Send, attempt: dict) -> tuple[bytes, dict]:
    """A webhook delivery's event on the attempts topic (key = its endpoint id), which endpoint health reads."""
    fields = webhook_fields(s)
    event = {"kind": "attempt", "delivery_id": s.send_id, "tenant_id": s.tenant_id, **fields, **attempt}
    return str(fields.get("endpoint_id") or "").encode(), event


def dropped_unattempted(made: int, now_ms: int, reason: str) -> dict:
    """The attempt of a webhook delivery given up on without an attempt of its own: `not_attempted` (never a failure
    of the endpoint), `dropped` for `reason` (its tenant's members hear of it: "Webhook event dropped")."""
    return {"n": made, "at_ms": now_ms, "status_code": None, "outcome": NOT_ATTEMPTED, "error": reason,
            "duration_ms": 0, "dropped": reason, "held": False}


def webhook_fields(s: Send) -> dict:
    """A webhook delivery's endpoint and event, for its endpoint's delivery list."""
    if s.channel != "webhook":
        return {}
    return {"endpoint_id": s.payload.get("endpoint_id"), "event_id": s.payload.get("event_id"),
            "event_type": s.payload.get("event_type")}


def events_of(doc: Any) -> list[dict]:
    """The outcome events a record's value holds (none when it is not an outcome record)."""
    if isinstance(doc, dict) and isinstance(doc.get("events"), list):
        return [e for e in doc["events"] if isinstance(e, dict)]
    return [doc] if isinstance(doc, dict) else []


# What becomes of a send, as its outcome events say: accepted at ingest; retrying or unknown (attempted, retried);
# then one of the final four. Another word is never recorded (it would be a metric label and a status of its own).
STATUSES = ("accepted", "retrying", "unknown", "delivered", "dead_lettered", "dropped", "skipped")
WHERE_KEYS = ("topic", "partition", "offset")  # what an event's `origin` and `dlq` say
_TEXT = ("provider", "reason", "provider_message_id", "replay_of", "endpoint_id", "event_id", "event_type", "channel",
         "lane")
_INTEGERS = ("attempts", "completed_at_ms", "created_at_ms", "accepted_at_ms")


def unidentified(event: dict) -> str | None:
    """Why an outcome event does not say which send it is about and what became of it, naming the
    field (None: it does; that is all a delivered mark needs)."""
    for name in ("send_id", "status", "tenant_id"):
        if not isinstance(event.get(name), str) or not event[name]:
            return f"'{name}' is not a non-empty string"
    return None


def _is_place(where: object, needed: tuple[str, ...]) -> bool:
    """An event's `origin` or `dlq`: an object of a text topic and integer partition and offset, the `needed` ones
    present (readers take them together: a DLQ offset without its partition names no letter). Its other keys are
    not read (each written became a field of the status hash: 4,000 passed what the status script can write, and
    the recorder retried the record for good)."""
    return isinstance(where, dict) and all(key in where for key in needed) and all(
        isinstance(value, str) if key == "topic" else isinstance(value, int) and not isinstance(value, bool)
        for key, value in where.items() if key in WHERE_KEYS)


def unusable(event: dict) -> str | None:
    """Why an outcome event cannot be recorded, naming the field (None: it can). Our writers never
    write such events; another producer on the topic, or a newer version, might."""
    problem = unidentified(event)
    if problem:
        return problem
    if event["status"] not in STATUSES:
        return f"'status' is not one of {', '.join(STATUSES)}"
    for name in _TEXT:
        if event.get(name) is not None and not isinstance(event[name], str):
            return f"'{name}' is not a string"
    for name in _INTEGERS:
        value = event.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            return f"'{name}' is not an integer"
    tried = event.get("providers_tried")
    if tried is not None and not (isinstance(tried, list) and all(isinstance(t, str) for t in tried)):
        return "'providers_tried' is not a list of strings"
    for name, needed in (("origin", WHERE_KEYS), ("dlq", ("partition", "offset"))):
        if event.get(name) is not None and not _is_place(event[name], needed):
            return f"'{name}' is not an object of {' and '.join(needed)} (a text topic, integer partition and offset)"
    attempt = event.get("attempt")
    if attempt is not None and not (isinstance(attempt, dict) and isinstance(attempt.get("n"), int)
                                    and not isinstance(attempt["n"], bool)):
        return "'attempt' is not an object with an integer 'n'"
    return None
