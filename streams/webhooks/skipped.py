"""Webhook deliveries ingest does not enqueue (their endpoint is degraded, or its backlog is shed):
recorded as `skipped`, visible in the endpoint's delivery list, and replayable for 7 days.

Each one is written to `notif.webhook.skipped` (key = delivery id, kept 7 days: the payload a replay
sends), then its outcome event, which points there, to `notif.outcomes` and the status store.
"""

from __future__ import annotations

import orjson

from ..ingest.publisher import Record, Written
from ..names import TopicNames
from ..outcomes import outcome_event
from ..send import Send, encode


def skipped_records(names: TopicNames, skipped: list[tuple[Send, str]]) -> list[Record]:
    return [Record(names.webhook_skipped, send.send_id.encode(), encode(send), (("reason", reason.encode()),))
            for send, reason in skipped]


def outcome_records(names: TopicNames, skipped: list[tuple[Send, str]], written: list[Written],
                    now_ms: int) -> list[tuple[dict, Record]]:
    """The `skipped` outcome of each, pointing at where its payload is kept."""
    out = []
    for (send, reason), w in zip(skipped, written, strict=True):
        event = {**outcome_event(send, "skipped", 0, now_ms, "webhook", reason=reason),
                 "origin": {"topic": w.topic, "partition": w.partition, "offset": w.offset}}
        out.append((event, Record(names.outcomes, send.send_id.encode(), orjson.dumps(event))))
    return out
