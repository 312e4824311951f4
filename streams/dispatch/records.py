"""What a lane worker writes to Kafka, durably: outcome events (`notif.outcomes`), copies for a
retry tier, and dead letters (`notif.dlq`, key = send id; headers: send_id, tenant, channel, lane,
reason, attempts, first/last error, origin topic/partition/offset, group, time).

Records are produced with the idempotent producer (acks=all); `on_ack` runs on the poll thread
once the broker acknowledged a record, which is where the worker finishes offsets. A record the
broker did not acknowledge is produced again with backoff until it is (the offset stays unstored
meanwhile), so a broker outage delays outcomes but never loses or freezes them.
"""

from __future__ import annotations

import logging
import time

import orjson
from confluent_kafka import Producer

from .. import metrics
from ..kafka_client import AckedWriter
from ..names import TopicNames
from ..providers.outcome import ProviderResult
from ..retry.policy import RetryAt
from ..send import Send
from .tenant_queues import Pending

log = logging.getLogger("streams.records")


def error_header(result: ProviderResult) -> bytes:
    """Status, error name and the (already redacted) body of a provider answer."""
    return f"{result.status or result.outcome} {result.error_name} {result.error_body}".strip().encode()[:1000]


class RecordWriter:
    def __init__(self, producer: Producer, names: TopicNames, channel: str, lane: str, provider: str,
                 topic: str, group: str):
        self.writer = AckedWriter(producer, f"{channel}.{lane}")
        self.names = names
        self.channel, self.lane, self.provider = channel, lane, provider
        self.topic, self.group = topic, group
        self._label = (channel, lane)

    def produce(self, topic: str, key: bytes | None, value: bytes | None, headers: dict, on_ack=None) -> None:
        """Write a record; `on_ack` runs once the broker acknowledged it (it is produced again until then)."""
        self.writer.write(topic, value, key, headers.items(), on_ack)

    def outcome_event(self, s: Send, status: str, attempts: int | None, now_ms: int,
                      provider_message_id: str = "", reason: str = "") -> dict:
        return {"send_id": s.send_id, "tenant_id": s.tenant_id, "channel": s.channel, "lane": s.lane,
                "status": status, "attempts": attempts, "provider": self.provider,
                "provider_message_id": provider_message_id, "reason": reason,
                "created_at_ms": s.created_at_ms, "completed_at_ms": now_ms,
                "latency_ms": max(0, now_ms - s.created_at_ms)}

    def delivered_elsewhere_event(self, send_id: str, tenant: str, now_ms: int, provider_message_id: str) -> dict:
        """The outcome of a send settled by a recovered request whose message another consumer holds."""
        return {"send_id": send_id, "tenant_id": tenant, "channel": self.channel, "lane": self.lane,
                "status": "delivered", "attempts": None, "provider": self.provider,
                "provider_message_id": provider_message_id, "reason": "", "completed_at_ms": now_ms}

    def outcome(self, event: dict, on_ack=None) -> None:
        self.produce(self.names.outcomes, event["send_id"].encode(), orjson.dumps(event), {}, on_ack)

    def retry(self, p: Pending, decision: RetryAt, result: ProviderResult, on_ack) -> None:
        """A copy of the original bytes for the tier; the route and payload never change."""
        headers = {**p.headers, "send_id": p.send.send_id.encode(), "tenant": p.send.tenant_id.encode(),
                   "lane": p.send.lane.encode(), "policy": p.send.policy.encode(),
                   "attempt": str(p.attempt + 1).encode(), "due_at_ms": str(decision.due_ms).encode(),
                   "tier": decision.tier.encode(), "retry_reason": decision.reason.encode(),
                   "origin_topic": self.topic.encode(), "last_error": error_header(result)}
        headers.setdefault("first_error", headers["last_error"])
        metrics.RETRIES.labels(*self._label, decision.tier).inc()
        metrics.SENDS.labels(*self._label, "retry").inc()
        self.produce(self.names.retry(self.channel, self.lane, decision.tier), p.send.tenant_id.encode(),
                     p.raw, headers, on_ack)

    def dead_letter(self, p: Pending, reason: str, result: ProviderResult | None, now_ms: int, on_ack) -> None:
        headers = {**p.headers, "send_id": p.send.send_id.encode(), "tenant": p.send.tenant_id.encode(),
                   "channel": p.send.channel.encode(), "lane": p.send.lane.encode(),
                   "reason": reason.encode(), "attempts": str(p.attempt).encode(),
                   "origin_topic": p.headers.get("origin_topic", self.topic.encode()),
                   "group": self.group.encode(), "dead_lettered_at_ms": str(now_ms).encode()}
        headers.setdefault("origin_partition", str(p.partition).encode())
        headers.setdefault("origin_offset", str(p.offset).encode())
        if result is not None:
            headers["last_error"] = error_header(result)
            headers.setdefault("first_error", headers["last_error"])
        metrics.DLQ.labels(*self._label, reason).inc()
        metrics.SENDS.labels(*self._label, "dead_lettered").inc()
        self.produce(self.names.dlq, p.send.send_id.encode(), p.raw, headers, on_ack)
        self.outcome(self.outcome_event(p.send, "dead_lettered", p.attempt, now_ms, reason=reason))

    def dead_letter_raw(self, msg, headers: dict[str, bytes], reason: str, detail: str, on_ack) -> None:
        """An event that never became a send: dead-letter it with the reason; the partition moves on."""
        log.warning("dead-lettering %s[%d]@%d: %s (%s)", msg.topic(), msg.partition(), msg.offset(),
                    reason, detail[:200])
        send_id = headers.get("send_id") or _peek_send_id(msg.value())
        dlq_headers = {**headers, "send_id": send_id, "reason": reason.encode(),
                       "detail": detail.encode()[:1000], "channel": self.channel.encode(),
                       "lane": self.lane.encode(), "origin_topic": msg.topic().encode(),
                       "origin_partition": str(msg.partition()).encode(),
                       "origin_offset": str(msg.offset()).encode(), "group": self.group.encode(),
                       "dead_lettered_at_ms": str(int(time.time() * 1000)).encode()}
        metrics.DLQ.labels(*self._label, reason).inc()
        self.produce(self.names.dlq, send_id or None, msg.value(), dlq_headers, on_ack)


def _peek_send_id(value: bytes | None) -> bytes:
    try:
        doc = orjson.loads(value or b"")
        return str(doc.get("send_id", "")).encode() if isinstance(doc, dict) else b""
    except orjson.JSONDecodeError:
        return b""
