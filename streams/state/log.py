"""The operator log: a compacted topic (`notif.operator`, one partition) holding the latest value
of every piece of operator state (a provider's limits, an API key, an endpoint, a project's members,
the Redis epoch). Every operator change is written here, acknowledged, before Redis; Redis is a
cache that can be rebuilt from it. Keys: `limits/<provider>`, `apikey/<sha256 of the key>`,
`endpoint/<id>`, `members/<tenant>`, `senders/<tenant>`, `epoch`."""

from __future__ import annotations

import enum
import logging
import time
import uuid
from collections.abc import Callable

import orjson
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition

from .. import metrics
from ..errors import PublishError, PublishOutcomeUnknown, StackError, StoreUnavailable, StoreWriteUnknown
from ..kafka_client import client_config, durable_producer, put_acked

TIMEOUT_S = 10.0
log = logging.getLogger("streams.operator_log")


def log_what_redis_holds(oplog: OperatorLog, key: str, read: Callable[[], bytes | None], after_success: bool,
                         attempts: int = 10, logged: bytes | None | bool = False, deletes: bool = True) -> None:
    """End a compare-and-set change of `key` by writing to the log what Redis holds now (`read()`), read again
    until it holds still. A change that lost its compare-and-set had logged its own record first, and
    another writer that lost one may log an older record after ours (it read Redis before our write):
    whichever writer touched Redis last logs last, so the log ends with what Redis holds, which a rebuild
    of Redis from it then restores. `after_success`: our own record is in the log already, so a write that
    fails here is only logged (the change is not failed for it); otherwise PublishError is raised. `logged`: the
    record our change logged (not logged again when Redis holds just that). `deletes=False`: Redis holding
    nothing is not logged (no change of this kind deletes: Redis lost its data, which the log restores)."""
    for _ in range(attempts):
        raw = read()
        if raw == logged or (raw is None and not deletes):
            return
        try:
            oplog.put(key, orjson.loads(raw) if raw else None)
        except PublishError:
            if not after_success:
                raise
            log.warning("%s: saved, but the operator log could not be written again after it (a concurrent "
                        "change's older record may be logged after ours)", key)
            return
        logged = raw


def take_back(oplog: OperatorLog, key: str, kept_if_unknown: dict | None, read: Callable[[], bytes | None],
              deletes: bool = True) -> None:
    """A change the log took and Redis failed to write (StoreUnavailable): the log must not keep it, for a rebuild
    of Redis from the log would apply a change the operator was told failed. The log gets what Redis holds, asked
    once (a Redis that answered nothing may have applied the write before its answer was lost, and a concurrent
    change may have landed meanwhile); while Redis does not answer, `kept_if_unknown`, usually what it held when the
    change read it (a Redis failing a write far more often refused it than applied it; a caller's retry mends the
    rest). With
    `deletes` False, Redis holding nothing is taken for its data lost, and the record stays: a tombstone would
    remove what a rebuild restores. Never raises: the caller raises the write's error."""
    try:
        held = read()
        value = orjson.loads(held) if held else None
    except StoreUnavailable:
        value = kept_if_unknown
    if value is None and not deletes:
        return
    try:
        oplog.put(key, value)
    except PublishError:
        log.warning("%s: refused by Redis, and the operator log could not be given what Redis holds (the next "
                    "change of it mends that)", key)


class _HeldBefore(enum.Enum):
    READ = "what Redis holds before the change, read first"


HELD_BEFORE = _HeldBefore.READ


def write_through_log(oplog: OperatorLog | None, key: str, record: dict | None, write: Callable[[], bool],
                      read: Callable[[], bytes | None], *, kept_if_unknown: dict | None | _HeldBefore = HELD_BEFORE,
                      deletes: bool = True, conditional: bool = True) -> bool:
    """One operator change: the log first, then Redis (`write()`: True written, False lost its compare-and-set to
    a concurrent change), then the log ends with what Redis holds (`log_what_redis_holds`). A write Redis refused
    (StoreUnavailable) is taken back out of the log (`take_back`, which logs `kept_if_unknown` while Redis cannot
    say what it holds: by default what `read()` gave before the change) and raised as StoreWriteUnknown (it may have
    been made: an answer lost). After a write that succeeded, a
    look at Redis that fails is only logged: the change was made, and its record is the log's (a concurrent change's
    older one may follow it). `conditional=False`: `write()` overwrites whatever Redis holds, so a concurrent
    change may have logged its record after ours and still lost to our write: what Redis holds is logged even
    when it is our own record. A log write left unconfirmed (it may still be written) is taken back too: the change
    is not made, and a rebuild must not make it. Without a log (`oplog` None), just `write()`."""
    if oplog is None:
        return write()
    if kept_if_unknown is HELD_BEFORE:
        held = read()
        kept_if_unknown = orjson.loads(held) if held else None
    try:
        oplog.put(key, record)
    except PublishOutcomeUnknown:
        take_back(oplog, key, kept_if_unknown, read, deletes)
        raise
    try:
        written = write()
    except StoreUnavailable as exc:
        take_back(oplog, key, kept_if_unknown, read, deletes)
        raise StoreWriteUnknown(str(exc)) from None
    ours = orjson.dumps(record) if written and conditional else False
    try:
        log_what_redis_holds(oplog, key, read, written, logged=ours, deletes=deletes)
    except StoreUnavailable as exc:
        if not written:
            raise
        log.warning("%s: saved, but Redis could not be read again after it (%s)", key, exc)
    return written


def skip_unreadable(topic: str, offset: int, key: bytes | str, why: str = "") -> None:
    """A state record a reader skips (its key keeps what it held): counted, and logged by topic, offset
    and key, never by value (endpoint records hold signing secrets)."""
    metrics.STATE_RECORDS_UNREADABLE.labels(topic).inc()
    log.error("skipping an unreadable record of %s at offset %d (key %r)%s", topic, offset, key[:80],
              f": {why}" if why else "")


class OperatorLog:
    def __init__(self, bootstrap: str, topic: str):
        self.bootstrap = bootstrap
        self.topic = topic
        self._producer = durable_producer(bootstrap, **{"message.timeout.ms": int(TIMEOUT_S * 1000)})

    def put(self, key: str, value: dict | None) -> None:
        """Write one entry (None deletes it) and wait for the broker's acknowledgement."""
        put_acked(self._producer, self.topic, key.encode(), None if value is None else orjson.dumps(value),
                  TIMEOUT_S + 5, f"the operator entry {key!r}")

    def snapshot(self) -> dict[str, dict]:
        """The latest value of every key (deleted keys left out), read from the start to the end. StackError when
        the log cannot be read (the broker failing however it does)."""
        try:
            return self._snapshot()
        except KafkaException as exc:
            raise StackError(f"cannot read the operator log {self.topic} ({exc})") from None

    def _snapshot(self) -> dict[str, dict]:
        c = Consumer(client_config(self.bootstrap, quiet=True, settings={
            "group.id": f"operator-log-reader-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False}))
        try:
            tp = TopicPartition(self.topic, 0)
            try:
                low, high = c.get_watermark_offsets(tp, timeout=TIMEOUT_S, cached=False)
            except KafkaException as exc:
                raise StackError(f"cannot read the operator log {self.topic} ({exc}); does it exist? "
                                 "(`streams topics apply`)") from None
            state: dict[str, dict] = {}
            if high <= low:
                return state
            c.assign([TopicPartition(self.topic, 0, OFFSET_BEGINNING)])
            position = low
            deadline = time.monotonic() + TIMEOUT_S
            while position < high:
                if time.monotonic() > deadline:
                    raise StackError(f"reading the operator log {self.topic} stalled at offset {position}")
                # consume() waits for a full batch or its timeout: short timeouts, an overall deadline.
                for m in c.consume(num_messages=1000, timeout=0.1):
                    if m.error():
                        continue
                    position = m.offset() + 1
                    key = (m.key() or b"").decode(errors="replace")
                    if m.value() is None:
                        state.pop(key, None)
                        continue
                    try:
                        value = orjson.loads(m.value())
                    except orjson.JSONDecodeError:
                        value = None
                    if not isinstance(value, dict):  # every entry is an object: skipped, its key as it was
                        skip_unreadable(self.topic, m.offset(), key)
                        continue
                    state[key] = value
            return state
        finally:
            c.close()
