"""Webhook deliveries ingest does not enqueue (their endpoint is degraded, or its backlog is shed):
recorded as `skipped`, visible in the endpoint's delivery list, and replayable for 7 days.

Each one is written to `notif.webhook.skipped` (key = delivery id, kept 7 days: the payload a replay
sends), then its outcome event, which points there, to `notif.outcomes` and the status store.
"""

from __future__ import annotations

import time

import orjson
from confluent_kafka import Producer

from .. import metrics
from ..errors import PublishError
from ..ingest.status import StatusStore
from ..kafka_client import produce
from ..names import TopicNames
from ..outcomes import outcome_event
from ..send import Send, encode


def record_skipped(producer: Producer, names: TopicNames, store: StatusStore, skipped: list[tuple[Send, str]],
                   timeout_s: float = 30.0) -> None:
    """Raises PublishError when the broker does not acknowledge them (the event is then refused whole)."""
    if not skipped:
        return
    positions: dict[str, dict] = {}
    failed: list[str] = []

    def on_delivery(err, msg) -> None:
        if err is not None:
            failed.append(err.str())
        else:
            positions[msg.key().decode()] = {"topic": msg.topic(), "partition": msg.partition(),
                                             "offset": msg.offset()}

    for send, reason in skipped:
        produce(producer, names.webhook_skipped, encode(send), key=send.send_id.encode(),
                headers=[("reason", reason.encode())], on_delivery=on_delivery)
    if producer.flush(timeout_s) or failed or len(positions) < len(skipped):
        raise PublishError(f"{names.webhook_skipped} did not acknowledge {len(skipped) - len(positions)} skipped "
                           f"deliveries ({failed[0] if failed else 'timed out'})")
    now_ms = int(time.time() * 1000)
    events = [{**outcome_event(send, "skipped", 0, now_ms, "webhook", reason=reason),
               "origin": positions[send.send_id]} for send, reason in skipped]
    for event in events:
        produce(producer, names.outcomes, orjson.dumps(event), key=event["send_id"].encode(), on_delivery=on_delivery)
    if producer.flush(timeout_s) or failed:
        raise PublishError(f"{names.outcomes} did not acknowledge skipped deliveries "
                           f"({failed[0] if failed else 'timed out'})")
    for event in events:
        store.record_outcome(event)
        metrics.SKIPPED_DELIVERIES.labels(event["reason"], "ingest").inc()
