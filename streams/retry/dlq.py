"""Reading `notif.dlq` for operators (`streams dlq list|show`): every dead letter, or one send's,
found by its recorded position or in the partitions its key maps to. Replays: `replay.py`.
Dead letters keep their payload 7 days (the topic's retention), like the lane topics."""

from __future__ import annotations

import heapq
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from ..errors import BrokerUnavailable, ReplayRefused
from ..kafka_client import client_config, partition_for, topic_partitions, watermarks
from ..providers.outcome import redact

# What a dead letter says of itself (each bounded): kept when the headers it carried from its record are
# too large for the DLQ.
OWN_DLQ_HEADERS = frozenset({
    "send_id", "tenant", "channel", "lane", "reason", "reason_detail", "detail", "attempts", "origin_topic",
    "origin_partition", "origin_offset", "group", "dead_lettered_at_ms", "first_error", "last_error",
    "providers_tried", "payload_omitted", "declined"})

PAYLOAD_DAYS = 7
# Records taken from the consumer at once: a dead letter may be 1.5 MiB with its payload, and records handed over
# no longer count against the consumer's prefetch bound (1,000 at once: up to 1.5 GB in the API process).
READ_BATCH = 32


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


def _read(bootstrap: str, topic: str, timeout_s: float, handle: Callable[[Any], None], complete: bool,
          tail: int | None = None) -> int:
    """Every record from the start (with `tail`: only the last `tail` of each partition) to the end offsets read at
    call time, in turn to `handle`; returns how many records the partitions hold. With `complete`, BrokerUnavailable
    when the broker did not give them all within `timeout_s` (else what came is all)."""
    c = Consumer(client_config(bootstrap, quiet=True, settings={
        "group.id": "dlq-reader", "enable.auto.commit": False,
        # A start offset retention has deleted meanwhile: from the oldest left, never the end (nothing).
        "auto.offset.reset": "earliest"}))
    try:
        parts = topic_partitions(c, topic)
        ends = {}
        assignment = []
        held = 0
        for p in parts:
            low, high = watermarks(c, TopicPartition(topic, p))
            held += max(0, high - low)
            if high > low:
                ends[p] = high
                assignment.append(TopicPartition(topic, p, low if tail is None else max(low, high - tail)))
        c.assign(assignment)
        remaining = dict(ends)
        deadline = time.monotonic() + timeout_s
        while remaining and time.monotonic() < deadline:
            for m in c.consume(num_messages=READ_BATCH, timeout=0.5):
                if m.error():
                    continue
                handle(m)
                if m.offset() + 1 >= ends.get(m.partition(), 0):
                    remaining.pop(m.partition(), None)
        if remaining and complete:
            raise BrokerUnavailable(f"{topic}: {len(remaining)} partition(s) not read to their end within "
                                    f"{timeout_s:.0f} s")
        return held
    finally:
        c.close()


def read_all(bootstrap: str, topic: str, timeout_s: float = 30.0) -> list[DeadLetterRecord]:
    """The records currently in the DLQ with their payloads, oldest first: what the broker gave within
    `timeout_s` (for tools and tests that poll; operators list with `latest`)."""
    out: list[DeadLetterRecord] = []
    _read(bootstrap, topic, timeout_s, lambda m: out.append(_record(m)), complete=False)
    return sorted(out, key=lambda r: r.timestamp_ms)


@dataclass(frozen=True)
class Listing:
    total: int                       # dead letters in the DLQ
    latest: list[DeadLetterRecord]   # the newest that matched, oldest first, without their payloads


def latest(bootstrap: str, topic: str, limit: int, reason: str | None = None, timeout_s: float = 30.0) -> Listing:
    """The newest `limit` dead letters (of `reason`), headers only: memory bounded by `limit` whatever the DLQ
    holds (a week of a blast's dead letters, payloads up to 1 MiB each); without `reason`, only the last `limit`
    of each partition are read (the newest `limit` are among them), so a full DLQ lists as fast as an empty one.
    BrokerUnavailable rather than a partial list when the broker does not give what it reads to the end within
    `timeout_s`. The total is what the DLQ's partitions hold."""
    kept: list[tuple[int, int, int, DeadLetterRecord]] = []  # a heap: the oldest kept first

    def keep(m: Any) -> None:
        r = _record(m, payload=False)
        if reason and r.reason != reason:
            return
        item = (r.timestamp_ms, r.partition, r.offset, r)  # the first three are unique: records never compared
        if len(kept) < limit:
            heapq.heappush(kept, item)
        else:
            heapq.heappushpop(kept, item)

    total = _read(bootstrap, topic, timeout_s, keep, complete=True, tail=None if reason else limit)
    return Listing(total, [r for *_, r in sorted(kept)])


def fetch(bootstrap: str, topic: str, partition: int, offset: int, timeout_s: float = 10.0) -> Any | None:
    """The one record at (partition, offset), or None when it is gone (retention) or absent;
    BrokerUnavailable when it is there but the broker did not give it in time."""
    # Deleted by retention between the watermarks and the fetch, the offset is out of range: read from the earliest
    # left (not the end, where it waited out the timeout and blamed the broker), it is seen to be gone.
    c = Consumer(client_config(bootstrap, quiet=True, settings={
        "group.id": f"record-reader-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False,
        "auto.offset.reset": "earliest"}))
    try:
        low, high = watermarks(c, TopicPartition(topic, partition))
        if not low <= offset < high:
            return None
        c.assign([TopicPartition(topic, partition, offset)])
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for m in c.consume(num_messages=1, timeout=0.2):
                if not m.error() and m.offset() == offset:
                    return m
                if not m.error() and m.offset() > offset:
                    return None
        raise BrokerUnavailable(f"{topic} [{partition}] did not give the record at offset {offset} within "
                                f"{timeout_s:.0f} s")
    finally:
        c.close()


def _record(m: Any, payload: bool = True) -> DeadLetterRecord:
    headers = {k: (v or b"").decode(errors="replace") for k, v in (m.headers() or [])}
    return DeadLetterRecord(m.partition(), m.offset(), (m.key() or b"").decode(errors="replace"),
                            m.value() if payload else None, headers, m.timestamp()[1])


def key_partitions(key: bytes, partitions: int) -> list[int]:
    """Every partition a record keyed `key` may be in, the one the current count maps it to first: a topic's
    partition count only grows, and a record written while it had fewer stays in the partition it was written to."""
    out: list[int] = []
    for count in range(partitions, 0, -1):
        if (partition := partition_for(key, count)) not in out:
            out.append(partition)
    return out


def find(bootstrap: str, topic: str, send_id: str, position: tuple[int, int] | None = None) -> DeadLetterRecord:
    """A send's dead letter: read at its recorded position (the status store keeps it), else searched in the
    partitions its key maps to at the DLQ's partition count or any smaller one (a letter written before the DLQ
    gained partitions), the current one first: a search that finds nothing reads each of those (about half of six
    partitions), each within 60 s."""
    if position is not None:
        m = fetch(bootstrap, topic, *position)
        if m is not None and (m.key() or b"").decode(errors="replace") == send_id:
            return _record(m)
    c = Consumer(client_config(bootstrap, quiet=True, settings={
        "group.id": f"dlq-finder-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False,
        "auto.offset.reset": "earliest"}))  # its first offsets deleted meanwhile: read on from what is left
    try:
        for partition in key_partitions(send_id.encode(), len(topic_partitions(c, topic))):
            if (found := _search(c, topic, partition, send_id)) is not None:
                return found
    finally:
        c.close()
    raise ReplayRefused(f"send {send_id} is not in the DLQ (never dead-lettered, or its dead letter has "
                        f"expired: dead letters are kept {PAYLOAD_DAYS} days)")


def _search(c: Consumer, topic: str, partition: int, send_id: str) -> DeadLetterRecord | None:
    """The last dead letter keyed `send_id` in one partition, read to the end it had when called (None when there
    is none); BrokerUnavailable when the broker does not give it all within 60 s (absent is not known then)."""
    low, high = watermarks(c, TopicPartition(topic, partition))
    if high <= low:
        return None
    c.assign([TopicPartition(topic, partition, low)])
    found = None
    position_now = low
    deadline = time.monotonic() + 60
    while position_now < high and time.monotonic() < deadline:
        for m in c.consume(num_messages=READ_BATCH, timeout=0.2):
            if m.error() or m.partition() != partition:
                continue
            position_now = m.offset() + 1
            if (m.key() or b"").decode(errors="replace") == send_id:
                found = _record(m)
    if found is None and position_now < high:
        raise BrokerUnavailable(f"{topic} [{partition}] was not read to its end within 60 s "
                                f"({high - position_now} records left)")
    return found


# Dispatch's own counts, offsets and times (redacted, an offset or a time in ms reads as a phone number), and the
# send id: shown as written when they have their shape. A producer may have set any header of its record, these
# names too, so a value of another shape is redacted like the rest.
_NUMBER_HEADERS = frozenset({"attempts", "attempt", "declined", "origin_partition", "origin_offset",
                             "dead_lettered_at_ms", "due_at_ms", "retried_at_ms"})
_NUMBER_RE = re.compile(r"\d{1,19}")
_SEND_ID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def shown_send_id(value: str) -> str:
    """A dead letter's send id as logs and operators are shown it: redacted unless it has a send id's shape (a
    record written to a lane directly that never became a send carries its producer's `send_id` header, or key)."""
    return value if _SEND_ID_RE.fullmatch(value) else redact(value, 300)


def redacted_headers(record: DeadLetterRecord) -> dict[str, str]:
    """A dead letter's headers as operators are shown them, every name kept, each value redacted (an error excerpt,
    or a header the producer set on its record, may quote a recipient or a credential) but dispatch's own numbers
    and the send id, when they have that shape."""
    def shown(name: str, value: str) -> str:
        if name in _NUMBER_HEADERS and _NUMBER_RE.fullmatch(value):
            return value
        return shown_send_id(value) if name == "send_id" else redact(value, 300)
    return {k: shown(k, v) for k, v in record.headers.items()}


def summary_line(record: DeadLetterRecord) -> str:
    """One dead letter in a list (`streams dlq list`), redacted as `describe` is."""
    h = redacted_headers(record)
    return (f"{shown_send_id(record.send_id):<38} {h.get('reason', ''):<18} attempts={h.get('attempts', '-'):<3} "
            f"tenant={h.get('tenant', '-')} lane={h.get('channel', '?')}.{h.get('lane', '?')}")


def describe(record: DeadLetterRecord) -> str:
    """A human summary without personal data (payload values redacted)."""
    lines = [f"send_id      {shown_send_id(record.send_id)}", f"reason       {redact(record.reason, 100)}",
             f"dlq position {record.partition}/{record.offset} at {record.timestamp_ms}"]
    headers = redacted_headers(record)
    for k in sorted(headers):
        if k not in ("send_id", "reason"):
            lines.append(f"{k:<12} {headers[k]}")
    lines.append(f"payload      {len(record.value or b'')} bytes" + ("" if record.value else " (not in the DLQ)"))
    return "\n".join(lines)
