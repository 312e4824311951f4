"""Webhook deliveries ingest does not enqueue (their endpoint is degraded, or its backlog is shed):
recorded as `skipped`, visible in the endpoint's delivery list, and replayable for 7 days.

Each one is written to `notif.webhook.skipped` (key = delivery id, kept 7 days: the payload a replay
sends), then its outcome event, which points there, to `notif.outcomes` and the status store.
"""

from __future__ import annotations

import time

import orjson

from .. import metrics
from ..ingest.publisher import Publisher, Record, Written
from ..ingest.status import StatusStore
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


async def record_skipped(publisher: Publisher, names: TopicNames, store: StatusStore,
                         skipped: list[tuple[Send, str]]) -> None:
    """Raises PublishError when the broker does not acknowledge them (the event is then refused whole)."""
    if not skipped:
        return
    written = await publisher.publish_async(skipped_records(names, skipped))
    outcomes = outcome_records(names, skipped, written, int(time.time() * 1000))
    await publisher.publish_async([r for _, r in outcomes])
    for event, _ in outcomes:
        store.record_outcome(event)
        metrics.SKIPPED_DELIVERIES.labels(event["reason"], "ingest").inc()
