"""The confluent-kafka adapter pieces every role shares: client settings, queueing a record, and
storing and committing tracked offsets. Each librdkafka setting says the guarantee it buys."""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from . import metrics
from .backoff import Outage
from .errors import BrokerUnavailable, PublishError, PublishOutcomeUnknown
from .offsets import OffsetTracker

_log = logging.getLogger("streams.kafka")
_quiet = logging.getLogger("streams.kafka.quiet")
_quiet.addHandler(logging.NullHandler())
_quiet.propagate = False


def client_config(bootstrap: str, quiet: bool = False, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """Common settings plus `settings`; `quiet` routes librdkafka's connection chatter to a silent logger."""
    conf: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        # librdkafka logs through Python logging instead of raw stderr lines.
        "logger": _quiet if quiet else _log,
        # Small records leave at once: no waiting for an earlier packet's acknowledgement (Nagle).
        "socket.nagle.disable": True,
    }
    conf.update(settings or {})
    return conf


MAX_RECORD_BYTES = 1_572_864  # the topics' max.message.bytes: a send (at most 1 MiB) plus room for headers


def durable_producer(bootstrap: str, **extra: Any) -> Producer:
    """A producer whose records are written once, in order, and acknowledged by all in-sync replicas.
    It carries records as large as the topics accept (librdkafka's own default is about 1 MB)."""
    return Producer(client_config(bootstrap, settings={"enable.idempotence": True, "acks": "all",
                                                       "message.max.bytes": MAX_RECORD_BYTES, **extra}))


def lane_consumer(bootstrap: str, group: str, commit_interval_ms: int = 1000, **extra: Any) -> Consumer:
    """A consumer for at-least-once processing: offsets are stored by the caller once a message's
    outcome is durable, and auto-commit only ever commits what was stored."""
    return Consumer(client_config(bootstrap, settings={
        "group.id": group,
        # Rebalances move only the partitions that change owner; the rest keep flowing.
        "partition.assignment.strategy": "cooperative-sticky",
        "enable.auto.offset.store": False,
        "enable.auto.commit": True,
        "auto.commit.interval.ms": commit_interval_ms,
        "auto.offset.reset": "earliest",
        # A crashed member's partitions move to another member within ~10 s.
        "session.timeout.ms": 10_000,
        "heartbeat.interval.ms": 1_000,
        **extra,
    }))


def after_all(n: int, then: Callable[[], object]) -> Callable[[], None]:
    """An acknowledgement callback to give `n` records: `then` runs once all `n` are acknowledged (a message's
    offset waits for every record it caused, so a crash in between writes them all again)."""
    left = [n]

    def one() -> None:  # runs inside the producer's poll: it must not raise
        left[0] -= 1
        if left[0] == 0:
            then()

    return one


def assign_in_callback(consumer: Consumer, partitions: list[TopicPartition]) -> None:
    """Inside on_assign (cooperative rebalancing), add `partitions` to what the consumer fetches now, so that a pause
    that follows holds. confluent-kafka would add them only once the callback returns, and librdkafka skips, without a
    word, a pause of a partition it does not know yet (all of a new consumer's first assignment): those partitions
    would be fetched while reported paused. Having been assigned here, the client does not assign them again."""
    if partitions:
        consumer.incremental_assign(partitions)


def produce(producer: Producer, topic: str, value: bytes | None, key: bytes | None = None,
            headers: Iterable[tuple[str, bytes]] | None = None,
            on_delivery: Callable | None = None, timeout_s: float | None = None) -> None:
    """Queue one record; while librdkafka's local queue is full, serve delivery reports and retry, for
    at most `timeout_s` (None: until it has room). Then raises KafkaException (_QUEUE_FULL): the record
    was not queued, so nothing of it can be written."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        try:
            producer.produce(topic, value=value, key=key, headers=list(headers or ()), on_delivery=on_delivery)
            return
        except BufferError:
            if deadline is not None and time.monotonic() >= deadline:
                raise KafkaException(KafkaError(KafkaError._QUEUE_FULL, f"the producer's local queue stayed full "
                                                f"for {timeout_s:.0f} s (the broker is not taking records)")) from None
            producer.poll(0.1)


# Delivery errors after which a record is known not to be in the log: the broker refused it, or it
# never left this client. After any other (a timeout, a lost connection, a producer id that changed
# while it was in flight) it may have been written: librdkafka knows which, the Python client does not say.
# Only the last attempt's error is known: an earlier attempt that timed out may have been written before
# a later one was refused (rare: an idempotent producer's retries end in _MSG_TIMED_OUT).
NOT_WRITTEN = frozenset({
    KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE, KafkaError.INVALID_MSG_SIZE,
    KafkaError.INVALID_MSG, KafkaError.INVALID_RECORD, KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC, KafkaError._UNKNOWN_PARTITION,
    KafkaError._PURGE_QUEUE, KafkaError._TIMED_OUT_QUEUE,
})


def may_be_written(err: KafkaError) -> bool:
    """After this delivery error, the record may still be in the log (a retry may duplicate it)."""
    return err.code() not in NOT_WRITTEN


def put_acked(producer: Producer, topic: str, key: bytes, value: bytes | None, timeout_s: float,
              what: str) -> None:
    """Write one record and wait for the broker's acknowledgement of it, not of the other records the
    producer holds (it may be shared with other requests); raises PublishError (naming `what`) when
    it does not come, saying whether the record may still be written."""
    done = threading.Event()
    failed: list[KafkaError] = []

    def on_delivery(err: KafkaError | None, _msg) -> None:  # on whichever thread polls the producer
        if err is not None:
            failed.append(err)
        done.set()

    deadline = time.monotonic() + timeout_s
    try:
        produce(producer, topic, value, key=key, on_delivery=on_delivery, timeout_s=timeout_s)
    except KafkaException as exc:  # not queued (e.g. the queue stayed full): nothing of it can be written
        raise PublishError(f"{topic} did not take {what} ({exc.args[0].str()}); nothing was written") from None
    while not done.is_set() and (left := deadline - time.monotonic()) > 0:
        producer.poll(min(left, 0.02))  # short: another thread polling a shared producer may run the callback
    if not done.is_set() or (failed and may_be_written(failed[0])):
        reason = failed[0].str() if failed else f"no answer within {timeout_s:.0f} s"
        raise PublishOutcomeUnknown(f"{topic} did not acknowledge {what} ({reason}); it may still be written")
    if failed:
        raise PublishError(f"{topic} did not acknowledge {what} ({failed[0].str()}); nothing was written")


def consume_ready(consumer: Consumer, max_messages: int, timeout: float,
                  returned: Callable[[], None] | None = None) -> list:
    """Up to `max_messages` messages, returning as soon as one is there (waiting at most `timeout`).
    librdkafka's consume(n, timeout) waits for n messages or the whole timeout: an idle worker would
    hold a lone OTP for up to its poll timeout. `returned` is called once the poll has returned a message,
    before the consume that follows it (which may serve a rebalance: see `store_offsets`)."""
    first = consumer.poll(timeout)
    if first is None:
        return []
    if returned is not None:
        returned()
    return [first, *consumer.consume(num_messages=max_messages - 1, timeout=0)] if max_messages > 1 else [first]


def store_offsets(consumer: Consumer, tracker: OffsetTracker, assigned: set[tuple[str, int]],
                  past_idle_to_position: bool = True) -> None:
    """Store, for each assigned partition, the lowest offset whose work is unfinished; auto-commit
    picks it up. A partition with nothing unfinished stores the consumer's position when that is
    further: the control records a producer transaction leaves (its commit marker takes an offset
    but is never returned to us) are then behind the stored offset too, and the lag reaches 0.
    That holds only while every message a poll returned is tracked: a caller storing from a
    rebalance callback that ran inside a consume, after the poll before it returned messages not
    tracked yet, passes `past_idle_to_position=False` (the position is past those messages). A partition
    nothing was taken from since it was assigned is idle too: its position can only have moved past
    control records (a previous owner that stopped before them left its commit there)."""
    committable = {tp: o for tp, o in tracker.committable().items() if tp in assigned}
    idle = [TopicPartition(t, p) for (t, p) in committable if past_idle_to_position and tracker.idle(t, p)]
    unseen = [TopicPartition(t, p) for (t, p) in sorted(assigned - committable.keys())] if past_idle_to_position else []
    if idle or unseen:
        try:
            for tp in consumer.position(idle + unseen):
                if tp.offset >= 0 and tp.offset > committable.get((tp.topic, tp.partition), -1):
                    committable[(tp.topic, tp.partition)] = tp.offset
        except KafkaException as exc:
            _log.debug("position: %s", exc)
    offsets = [TopicPartition(t, p, o) for (t, p), o in committable.items()]
    if offsets:
        try:
            consumer.store_offsets(offsets=offsets)
        except Exception as exc:  # noqa: BLE001 - a partition revoked meanwhile (_STATE) is benign
            _log.debug("store_offsets: %s", exc)


def store_message_offset(consumer: Consumer, msg: Any) -> None:
    """Store the offset after one processed message (ignored for a partition revoked meanwhile)."""
    try:
        consumer.store_offsets(message=msg)
    except Exception as exc:  # noqa: BLE001 - a partition revoked meanwhile (_STATE) is benign
        _log.debug("store_offsets: %s", exc)


def commit_now(consumer: Consumer) -> None:
    """Commit what was stored, synchronously (on revoke and at shutdown)."""
    try:
        consumer.commit(asynchronous=False)
    except Exception as exc:  # noqa: BLE001 - "no offset stored" is not an error here
        _log.debug("commit: %s", exc)


@dataclass
class _Record:
    topic: str
    value: bytes | None
    key: bytes | None
    headers: list[tuple[str, bytes]]
    on_ack: Callable[[], object] | None
    on_refused: Callable[[KafkaError], object] | None
    on_written: Callable[[int, int], object] | None = None
    alone: bool = False   # produced in a batch of its own (after the broker refused the batch it was in)
    alone_tries: int = 0

    @cached_property
    def size(self) -> int:  # read when written and when settled
        return len(self.value or b"") + len(self.key or b"") + sum(len(k) + len(v or b"") for k, v in self.headers)


ALONE_FLUSH_S = 1.0  # how long a record tried alone waits for the queue to empty, before and after it
ALONE_TRIES = 3      # tries alone not confirmed alone (a slow broker) before a refusal is taken as the record's own
# Errors that producing again cannot fix: the record itself is refused.
REFUSED = frozenset({KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.INVALID_RECORD, KafkaError.RECORD_LIST_TOO_LARGE})


# What produce() raises at once for a topic librdkafka knows it cannot write to now: denied, or not there.
TOPIC_UNAVAILABLE = frozenset({KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError._UNKNOWN_TOPIC,
                               KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_PARTITION})


class AckedWriter:
    """Writes records whose acknowledgement matters (outcomes, retry copies, dead letters).

    `on_ack` runs on the calling thread (inside `poll`) once the broker acknowledged the record. A
    record the broker did not acknowledge (down past the delivery timeout, leader gone) is produced
    again, with backoff, until it is: the caller's offset stays unstored meanwhile, so nothing is
    lost and nothing freezes silently (a metric and one log line per episode say so). Each topic has
    a backoff of its own: records of one topic acknowledged meanwhile (the outcomes, while a retry tier's
    partitions lack their replicas) neither end another's episode nor reset its backoff. A record the
    broker refuses for what it is (too large) goes to `on_refused` when given, instead of a loop.
    The broker refuses a whole batch of records for its size: a record refused in a batch is first
    produced again alone, so that only a record too large by itself goes to `on_refused`.
    """

    def __init__(self, producer: Producer, label: str):
        self.producer = producer
        self.label = label
        self.outages: dict[str, Outage] = {}  # per topic, from its first failure
        self._failed: list[_Record] = []
        self._refused_in_a_batch: list[_Record] = []
        self.unacknowledged = 0
        self.pending_bytes = 0  # what the records of `pending` weigh (values, keys, headers)
        # Records that failed at least once and are not settled yet (by id) -> their first failure (monotonic)
        self._failing_since: dict[int, float] = {}

    def write(self, topic: str, value: bytes | None, key: bytes | None = None,
              headers: Iterable[tuple[str, bytes]] | None = None, on_ack: Callable[[], object] | None = None,
              on_refused: Callable[[KafkaError], object] | None = None,
              on_written: Callable[[int, int], object] | None = None) -> None:
        """`on_written(partition, offset)` runs just before `on_ack`, with where the record landed."""
        record = _Record(topic, value, key, list(headers or ()), on_ack, on_refused, on_written)
        self.pending_bytes += record.size
        self._produce(record)

    def _settled(self, record: _Record) -> None:
        self.pending_bytes -= record.size
        if self._failing_since:
            self._failing_since.pop(id(record), None)

    def _produce(self, record: _Record) -> None:
        def on_failed(err: KafkaError) -> None:
            metrics.PRODUCE_RETRIES.labels(self.label).inc()
            now = time.monotonic()
            self._failing_since.setdefault(id(record), now)
            self.outage(record.topic).failed(now, err)
            record.alone = False  # produced again with others: a size refusal then says nothing of it alone
            self._failed.append(record)

        def on_delivery(err: KafkaError | None, msg: Any) -> None:
            self.unacknowledged -= 1
            if err is None:
                self._settled(record)
                if record.topic in self.outages:
                    self.outages[record.topic].recovered(time.monotonic())
                if record.on_written is not None:
                    record.on_written(msg.partition(), msg.offset())
                if record.on_ack is not None:
                    record.on_ack()
            elif err.code() in REFUSED and record.on_refused is not None and not record.alone:
                record.alone = True  # perhaps only its batch was too large: it is tried alone first
                self._refused_in_a_batch.append(record)
            elif err.code() in REFUSED and record.on_refused is not None:
                _log.error("%s refused a record for %s: %s", self.label, record.topic, err)
                self._settled(record)
                record.on_refused(err)
            else:
                on_failed(err)

        self.unacknowledged += 1
        try:
            produce(self.producer, record.topic, record.value, key=record.key, headers=record.headers,
                    on_delivery=on_delivery)
        except KafkaException as exc:  # refused before it left the process (e.g. over message.max.bytes)
            self.unacknowledged -= 1
            err = exc.args[0]
            if err.code() in REFUSED and record.on_refused is not None:
                _log.error("%s refused a record for %s: %s", self.label, record.topic, err)
                self._settled(record)
                record.on_refused(err)
                return
            if err.code() not in TOPIC_UNAVAILABLE:  # a fenced or failed producer, a bug: the role stops
                self._settled(record)
                raise
            # A topic the cluster denies or does not have (an ACL, a tier made by an upgrade before `topics
            # apply`): once librdkafka has marked it so, every produce to it fails here, at once. Kept and
            # produced again after the backoff, as a failed delivery is (the caller's offsets stay unstored);
            # raising made the role crash again on every restart, at the first record for that topic.
            on_failed(err)

    def poll(self, timeout: float = 0) -> None:
        """Serve delivery reports; produce again what failed, once the backoff allows."""
        self.producer.poll(timeout)
        while self._refused_in_a_batch:  # rare: each goes once the producer's queue is empty, and alone
            if self.producer.flush(ALONE_FLUSH_S):
                break  # a slow broker: it would join a batch again; tried on a later poll
            record = self._refused_in_a_batch.pop(0)
            record.alone_tries += 1
            self._produce(record)
            if self.producer.flush(ALONE_FLUSH_S) and record.alone_tries < ALONE_TRIES:
                # Not acknowledged in time: records produced next may join its batch, so a refusal of that
                # batch would not be its own; it is tried alone again instead of given up on.
                record.alone = False
        if self._failed:
            now = time.monotonic()
            again = [r for r in self._failed if self.outages[r.topic].ready(now)]
            self._failed = [r for r in self._failed if not self.outages[r.topic].ready(now)]
            for record in again:
                self._produce(record)
        metrics.PRODUCE_PENDING.labels(self.label).set(self.pending)
        metrics.PRODUCE_FAILING.labels(self.label).set(self.failing_s(time.monotonic()))

    def failing_s(self, now: float) -> float:
        """How long ago the oldest record still unacknowledged first failed (0: none). Per record, not per
        topic: one partition the broker cannot write (below its min.insync.replicas) fails on while the
        topic's other partitions acknowledge."""
        return now - min(self._failing_since.values(), default=now)

    def outage(self, topic: str) -> Outage:
        if topic not in self.outages:
            self.outages[topic] = Outage(f"Kafka ({self.label} writes to {topic})", base_s=0.5, cap_s=10.0)
        return self.outages[topic]

    @property
    def pending(self) -> int:
        """Records not yet acknowledged (in flight or waiting to be produced again)."""
        return len(self._failed) + len(self._refused_in_a_batch) + self.unacknowledged

    @property
    def awaiting(self) -> bool:
        """Whether an acknowledgement (or a try alone) can come at any moment; records that only wait out a
        backoff are not (`next_try_at` says when they go)."""
        return bool(self.unacknowledged or self._refused_in_a_batch)

    @property
    def next_try_at(self) -> float | None:
        """When the first record waiting out a backoff is produced again (None: none waits)."""
        return min((self.outages[r.topic].next_try_at for r in self._failed), default=None)

    def drain(self, timeout_s: float) -> bool:
        """Flush until every record is acknowledged or `timeout_s` passes; True when all were."""
        deadline = time.monotonic() + timeout_s
        while self.pending and time.monotonic() < deadline:
            self.producer.flush(min(1.0, max(0.0, deadline - time.monotonic())))
            self.poll(0)
            if (next_try_at := self.next_try_at) is not None:
                time.sleep(min(0.2, max(0.0, next_try_at - time.monotonic())))
        return self.pending == 0


# The errors a watermark read asks again on. Decided by code: the KafkaError that
# get_watermark_offsets raises never has its retriable() flag set, even for NOT_LEADER_FOR_PARTITION.
WATERMARK_RETRIABLE = frozenset({
    KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE, KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError.FENCED_LEADER_EPOCH, KafkaError.UNKNOWN_LEADER_EPOCH, KafkaError.OFFSET_NOT_AVAILABLE,
    KafkaError.REQUEST_TIMED_OUT, KafkaError._TIMED_OUT, KafkaError._TRANSPORT, KafkaError._UNKNOWN_PARTITION,
})


def _one_try_s(deadline: float) -> float:
    """A try's own bound within a read that asks again until `deadline`: a few seconds at most."""
    return min(3.0, max(0.1, deadline - time.monotonic()))


def described_partitions(c: Consumer, topic: str, timeout_s: float) -> list[int]:
    """A topic's partitions from one metadata request; BrokerUnavailable saying what the answer held instead when
    it has none (the topic missing, or described with an error: the caller names the topic), never an empty list."""
    meta = c.list_topics(topic, timeout=timeout_s).topics.get(topic)
    if meta is None or meta.error is not None or not meta.partitions:
        raise BrokerUnavailable("missing" if meta is None else str(meta.error) if meta.error is not None
                                else "no partitions")
    return sorted(meta.partitions)


def topic_partitions(c: Consumer, topic: str, timeout_s: float = 10.0) -> list[int]:
    """A topic's partitions. Its metadata may come with an error and no partitions for a moment (a leader just
    moved, a broker busy): asked again until timeout_s, then BrokerUnavailable. Taken as it came, that empty list
    read as an empty topic: a dead-letter listing "0 of 0" passed off as whole, a recovery that restored nothing."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return described_partitions(c, topic, _one_try_s(deadline))
        except (KafkaException, BrokerUnavailable) as exc:
            if time.monotonic() >= deadline:
                raise BrokerUnavailable(f"the broker did not describe topic {topic} within {timeout_s:.0f} s "
                                        f"({exc})") from None
        time.sleep(0.2)  # backoff before asking again, not synchronisation


def watermarks(c: Consumer, tp: TopicPartition, timeout_s: float = 10.0) -> tuple[int, int]:
    """A partition's low and high offsets. A retriable error (a topic just created, a broker just started
    or a leader just moved: NOT_LEADER_FOR_PARTITION) is asked again until timeout_s, as the producer
    would: each try is bounded to a few seconds, and the client's metadata is refreshed before the next
    one, so a stale leader in its cache is not asked again and again."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return c.get_watermark_offsets(tp, timeout=_one_try_s(deadline), cached=False)
        except KafkaException as exc:
            if exc.args[0].code() not in WATERMARK_RETRIABLE or time.monotonic() >= deadline:
                raise
            time.sleep(0.2)  # backoff before asking again, not synchronisation
            try:
                c.list_topics(tp.topic, timeout=_one_try_s(deadline))
            except KafkaException:
                pass  # the next try reports what is wrong


def partition_for(key: bytes, partitions: int) -> int:
    """librdkafka's default partitioner (consistent_random: CRC32 of the key): where a key's records are."""
    return zlib.crc32(key) % partitions
