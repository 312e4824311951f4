"""Operator tools for `notif.dlq`: list, show and replay dead letters (`streams dlq ...`).

Replay re-publishes the send's original bytes to the lane its category belongs to, as attempt 1 of
a new attempt record (headers `replay_of`, `replayed_at_ms`). It refuses, saying why, when the
payload is gone (expired or never a valid send).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from confluent_kafka import Consumer, TopicPartition

from ..errors import DispatchError, MalformedEvent, ReplayRefused
from ..kafka_client import client_config, durable_producer, produce
from ..names import TopicNames
from ..providers.outcome import redact
from ..send import decode


@dataclass(frozen=True)
class DeadLetterRecord:
    partition: int
    offset: int
    key: str
    value: bytes | None
    headers: dict[str, str]
    timestamp_ms: int

    @property
    def send_id(self) -> str:
        return self.headers.get("send_id") or self.key

    @property
    def reason(self) -> str:
        return self.headers.get("reason", "")


def read_all(bootstrap: str, topic: str, timeout_s: float = 30.0) -> list[DeadLetterRecord]:
    """Every record currently in the DLQ (from the start to the end offsets read at call time)."""
    c = Consumer(client_config(bootstrap, quiet=True, settings={"group.id": "dlq-reader", "enable.auto.commit": False}))
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        ends = {}
        assignment = []
        for p in parts:
            low, high = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            if high > low:
                ends[p] = high
                assignment.append(TopicPartition(topic, p, low))
        c.assign(assignment)
        out: list[DeadLetterRecord] = []
        remaining = dict(ends)
        deadline = time.monotonic() + timeout_s
        while remaining and time.monotonic() < deadline:
            for m in c.consume(num_messages=1000, timeout=0.5):
                if m.error():
                    continue
                headers = {k: (v or b"").decode(errors="replace") for k, v in (m.headers() or [])}
                out.append(DeadLetterRecord(m.partition(), m.offset(), (m.key() or b"").decode(errors="replace"),
                                            m.value(), headers, m.timestamp()[1]))
                if m.offset() + 1 >= ends.get(m.partition(), 0):
                    remaining.pop(m.partition(), None)
        return sorted(out, key=lambda r: r.timestamp_ms)
    finally:
        c.close()


def find(records: list[DeadLetterRecord], send_id: str) -> DeadLetterRecord:
    matches = [r for r in records if r.send_id == send_id]
    if not matches:
        raise ReplayRefused(f"send {send_id} is not in the DLQ (never dead-lettered, or past the DLQ's "
                            "30-day retention)")
    return matches[-1]


def replay(bootstrap: str, names: TopicNames, record: DeadLetterRecord) -> str:
    """Re-publish a dead letter to its lane; returns the lane topic."""
    if not record.value:
        raise ReplayRefused(f"the payload of send {record.send_id} is gone (removed by retention); "
                            "nothing is left to send")
    try:
        send = decode(record.value)
    except MalformedEvent as exc:
        raise ReplayRefused(f"send {record.send_id} cannot be replayed: its event is not a valid send "
                            f"({exc.reason}: {exc.detail})") from None
    topic = names.lane(send.channel, send.lane)  # a lane violation goes back to its proper lane
    producer = durable_producer(bootstrap)
    headers = [("send_id", send.send_id.encode()), ("attempt", b"1"),
               ("replay_of", f"{names.dlq}/{record.partition}/{record.offset}".encode()),
               ("replayed_at_ms", str(int(time.time() * 1000)).encode()),
               ("first_error", record.headers.get("first_error", "").encode())]
    produce(producer, topic, record.value, key=send.tenant_id.encode(), headers=headers)
    if producer.flush(30) != 0:
        raise DispatchError(f"the broker did not acknowledge the replay of {send.send_id}")
    return topic


def describe(record: DeadLetterRecord) -> str:
    """A human summary without personal data (payload values redacted)."""
    lines = [f"send_id      {record.send_id}", f"reason       {record.reason}",
             f"dlq position {record.partition}/{record.offset} at {record.timestamp_ms}"]
    for k in sorted(record.headers):
        if k not in ("send_id", "reason"):
            lines.append(f"{k:<12} {redact(record.headers[k], 300)}")
    lines.append(f"payload      {len(record.value or b'')} bytes" + ("" if record.value else " (gone)"))
    return "\n".join(lines)
