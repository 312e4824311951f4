"""Send status for `GET /v1/sends/{id}`: written `accepted` at ingest, then kept current from
`notif.outcomes` by the outcome recorder (`streams outcome-recorder`). Redis hash per send."""

from __future__ import annotations

import time

import orjson
import redis

from . import metrics

STATUS_TTL_S = 30 * 24 * 3600  # as long as notif.outcomes keeps outcomes


class StatusStore:
    def __init__(self, client: redis.Redis, namespace: str = ""):
        self.client = client
        self.ns = namespace

    def _key(self, send_id: str) -> str:
        return f"{self.ns}dr:send:{send_id}"

    def accepted(self, sends: list) -> None:
        pipe = self.client.pipeline(transaction=False)
        now = int(time.time() * 1000)
        for s in sends:
            key = self._key(s.send_id)
            pipe.hset(key, mapping={"tenant_id": s.tenant_id, "status": "accepted", "channel": s.channel,
                                    "lane": s.lane, "accepted_at_ms": now, "attempts": 0})
            pipe.expire(key, STATUS_TTL_S)
        pipe.execute()

    def record_outcome(self, event: dict) -> None:
        """Apply an outcome event; a terminal `delivered` is never overwritten by a later duplicate."""
        key = self._key(event["send_id"])
        current = self.client.hget(key, "status")
        if current == b"delivered" and event["status"] != "delivered":
            return
        fields = {"status": event["status"], "tenant_id": event["tenant_id"],
                  "completed_at_ms": event.get("completed_at_ms") or 0,
                  "provider": event.get("provider") or "", "reason": event.get("reason") or "",
                  "provider_message_id": event.get("provider_message_id") or ""}
        if event.get("attempts"):
            fields["attempts"] = event["attempts"]
        self.client.hset(key, mapping=fields)
        self.client.expire(key, STATUS_TTL_S)

    def get(self, send_id: str) -> dict | None:
        raw = self.client.hgetall(self._key(send_id))
        if not raw:
            return None
        doc = {k.decode(): v.decode() for k, v in raw.items()}
        for k in ("attempts", "accepted_at_ms", "completed_at_ms"):
            if k in doc:
                doc[k] = int(doc[k] or 0)
        return doc


def run_recorder(bootstrap: str, store: StatusStore, topic: str, group: str, until=None) -> None:
    """Consume notif.outcomes into the status store (at-least-once; applying twice is harmless)."""
    from confluent_kafka import Consumer

    from .kafka_config import client_config

    consumer = Consumer(client_config(bootstrap, **{
        "group.id": group, "auto.offset.reset": "earliest", "enable.auto.commit": True,
        "enable.auto.offset.store": False, "partition.assignment.strategy": "cooperative-sticky"}))
    consumer.subscribe([topic])
    try:
        while not (until and until()):
            for msg in consumer.consume(num_messages=500, timeout=0.2):
                if msg.error():
                    continue
                try:
                    event = orjson.loads(msg.value())
                    store.record_outcome(event)
                    metrics.OUTCOMES_RECORDED.labels(event.get("status", "")).inc()
                except (orjson.JSONDecodeError, KeyError, TypeError):
                    pass  # not an outcome event; nothing to record
                consumer.store_offsets(message=msg)
    finally:
        consumer.close()
