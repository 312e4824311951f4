"""The audit trail: every operator change (limits and quotas, sender domains, API keys, replays,
webhook endpoints, state recovery) as one record on `notif.audit`: who (the operator key's id, or
`cli:<user>@<host>`), what, the state before and after, when. Written once the change is applied
(the API answers after the broker acknowledged it; the CLI prints what it did first, then records it,
and exits 4 when the broker does not confirm the record); read with `streams audit`. Secrets never
appear in it (keys by id).
"""

from __future__ import annotations

import getpass
import os
import socket
import time
import uuid
from collections.abc import Iterator

import orjson
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from ..errors import BrokerUnavailable
from ..kafka_client import client_config, durable_producer, put_acked
from .log import skip_unreadable

TIMEOUT_S = 10.0


def cli_actor() -> str:
    """`cli:<user>@<host>`; a process whose user has no name (an arbitrary uid without a passwd entry, no USER
    nor LOGNAME: a container's) is `uid:<n>`, not a failure after its change was made."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid:{os.getuid()}"
    return f"cli:{user}@{socket.gethostname()}"


class AuditLog:
    def __init__(self, bootstrap: str, topic: str):
        self.bootstrap, self.topic = bootstrap, topic
        self._producer = durable_producer(bootstrap, **{"message.timeout.ms": int(TIMEOUT_S * 1000)})

    def record(self, who: str, what: str, before: object, after: object) -> dict:
        entry = {"at_ms": int(time.time() * 1000), "who": who, "what": what, "before": before, "after": after}
        put_acked(self._producer, self.topic, what.encode(), orjson.dumps(entry), TIMEOUT_S + 5, f"the audit of {what}")
        return entry

    def read(self, since_ms: int = 0) -> Iterator[dict]:
        """Every entry at or after `since_ms`, oldest first (from the topic's start to its end now)."""
        c = Consumer(client_config(self.bootstrap, quiet=True, settings={
            "group.id": f"audit-reader-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False}))
        try:
            tp = TopicPartition(self.topic, 0)
            low, high = c.get_watermark_offsets(tp, timeout=TIMEOUT_S, cached=False)
            if high <= low:
                return
            c.assign([TopicPartition(self.topic, 0, OFFSET_BEGINNING)])
            position, deadline = low, time.monotonic() + 30
            while position < high and time.monotonic() < deadline:
                for m in c.consume(num_messages=500, timeout=0.2):
                    if m.error():
                        continue
                    position = m.offset() + 1
                    entry = _entry(m.value())
                    if entry is None:  # kept for a year: one bad record must not hide the rest
                        skip_unreadable(self.topic, m.offset(), m.key() or b"")
                    elif entry["at_ms"] >= since_ms:
                        yield entry
            if position < high:  # a partial trail would read as "no such change": said, not answered
                raise BrokerUnavailable(f"the audit trail {self.topic} was read to offset {position} of {high} in 30 s "
                                 "(its broker is slow or away); ask again")
        finally:
            c.close()


def _entry(value: bytes | None) -> dict | None:
    """An audit entry as `record` writes it (None: a record that is not one)."""
    try:
        entry = orjson.loads(value) if value is not None else None
    except orjson.JSONDecodeError:
        return None
    if not (isinstance(entry, dict) and isinstance(entry.get("at_ms"), int) and isinstance(entry.get("who"), str)
            and isinstance(entry.get("what"), str) and "before" in entry and "after" in entry):
        return None
    return entry
