"""Send status for `GET /v1/sends/{id}`: written `accepted` at ingest, then kept current from
`notif.outcomes` by the outcome recorder (`streams outcome-recorder`). A Redis hash per send."""

from __future__ import annotations

import time
from collections.abc import Callable

import orjson
import redis

from .. import metrics
from ..kafka_client import lane_consumer
from ..names import RedisKeys

STATUS_TTL_S = 30 * 24 * 3600  # as long as notif.outcomes keeps outcomes


class StatusStore:
    def __init__(self, client: redis.Redis, namespace: str = ""):
        self.client = client
        self.keys = RedisKeys(namespace)

    def accepted(self, sends: list) -> None:
        pipe = self.client.pipeline(transaction=False)
        now = int(time.time() * 1000)
        for s in sends:
            key = self.keys.send_status(s.send_id)
            pipe.hset(key, mapping={"tenant_id": s.tenant_id, "status": "accepted", "channel": s.channel,
                                    "lane": s.lane, "accepted_at_ms": now, "attempts": 0})
            pipe.expire(key, STATUS_TTL_S)
        pipe.execute()

    def record_outcome(self, event: dict) -> None:
        """Apply an outcome event; a terminal `delivered` is never overwritten by a later duplicate."""
        key = self.keys.send_status(event["send_id"])
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
        raw = self.client.hgetall(self.keys.send_status(send_id))
        if not raw:
            return None
        doc = {k.decode(): v.decode() for k, v in raw.items()}
        for k in ("attempts", "accepted_at_ms", "completed_at_ms"):
            if k in doc:
                doc[k] = int(doc[k] or 0)
        return doc


class OutcomeRecorder:
    """Consumes notif.outcomes into the status store (at-least-once; applying twice is harmless)."""

    def __init__(self, bootstrap: str, store: StatusStore, topic: str, group: str):
        self.store = store
        self.topic = topic
        self.consumer = lane_consumer(bootstrap, group)
        self.running = True

    def stop(self, *_: object) -> None:
        self.running = False

    def run(self, until: Callable[[], bool] | None = None) -> None:
        self.consumer.subscribe([self.topic])
        try:
            while self.running and not (until and until()):
                for msg in self.consumer.consume(num_messages=500, timeout=0.2):
                    if msg.error():
                        continue
                    try:
                        event = orjson.loads(msg.value())
                        self.store.record_outcome(event)
                        metrics.OUTCOMES_RECORDED.labels(event.get("status", "")).inc()
                    except (orjson.JSONDecodeError, KeyError, TypeError):
                        pass  # not an outcome event; nothing to record
                    self.consumer.store_offsets(message=msg)
        finally:
            self.consumer.close()
