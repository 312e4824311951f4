"""The delayed-retry consumer: `streams retrier --channel email --lane marketing`.

One retrier process serves every retry tier of a lane (`notif.{channel}.{lane}.retry.{tier}`), so
no tier can be deployed without a consumer; copies of it share the work as one consumer group.
Each message is released at its own due time (the `due_at_ms` header: jitter and Retry-After make
due times differ inside one partition), never before, whatever is ahead of it in the partition:
the retrier reads messages into a heap ordered by due time and re-publishes each one, byte for
byte with its headers, to its lane topic when it is due. Nothing sleeps in the poll loop; the
poll timeout is the time to the next due message (at most 0.5 s).

Offsets are tracked per partition and stored only up to the lowest message not yet acknowledged
in its lane topic, so a crash (or a rebalance) re-reads every message from there on: the unreleased
ones, and those released behind them. Behind a copy due far ahead (a long Retry-After, a tenant's
excess parked for hours) that can be many: already past due, they are released again at once, and
the lane worker's idempotency makes each a duplicate it skips (`stale` or `duplicate`), never a
second send. Memory is bounded (`memory_bound.py`): past `max_held` messages
or `max_held_bytes` the retrier pauses the partitions holding messages due late, so the short tiers
keep flowing; past twice that (late ones counted up to the bound), those holding more than an even share of the
bound too (one tenant's backlog), or every partition; each until half is released.
A copy the broker did not acknowledge is produced again until it is.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from confluent_kafka import TIMESTAMP_NOT_AVAILABLE, KafkaError, TopicPartition

from .. import metrics
from ..backoff import Outage
from ..errors import MalformedEvent
from ..kafka_client import (
    AckedWriter,
    after_all,
    assign_in_callback,
    commit_now,
    consume_ready,
    durable_producer,
    lane_consumer,
    store_offsets,
)
from ..lanes import RETRY_TIERS
from ..names import TopicNames
from ..offsets import OffsetTracker
from ..outcomes import attempt_event, dropped_unattempted, outcome_event
from ..send import decode, peek_send_id, plausible_send_id
from .dlq import OWN_DLQ_HEADERS
from .memory_bound import MemoryBound, Partition, PartitionLoad, far_loads

log = logging.getLogger("streams.retrier")
MAX_POLL_WAIT_S = 0.5


@dataclass(frozen=True)
class RetrierConfig:
    channel: str
    lane: str
    bootstrap: str
    names: TopicNames = field(default_factory=TopicNames)
    commit_interval_ms: int = 1000
    delivery_timeout_ms: int = 60_000
    max_held: int = 100_000
    max_held_bytes: int = 256 * 1024 * 1024

    @property
    def topics(self) -> list[str]:
        return [self.names.retry(self.channel, self.lane, tier) for tier in RETRY_TIERS]

    @property
    def group(self) -> str:
        return self.names.retry_group(self.channel, self.lane)


@dataclass(order=True)
class Held:
    due_ms: int
    offset: int
    topic: str = field(compare=False)
    partition: int = field(compare=False)
    key: bytes | None = field(compare=False)
    value: bytes | None = field(compare=False)
    headers: dict[str, bytes] = field(compare=False)
    read_ms: float = field(default=0.0, compare=False)  # when this retrier read it (overdue counts from then at most)

    @property
    def size(self) -> int:
        return len(self.value or b"") + sum(len(k) + len(v or b"") for k, v in self.headers.items())


# Nothing is due later than the lanes keep payloads (7 days): a retry is due within its tier (at most
# 12 h), a parked message when its tenant's turn comes (spills of a slow tenant may wait days).
LATEST_DUE_MS = 7 * 24 * 3600 * 1000


def due_time(headers: dict[str, bytes], where: str, now_ms: float, written_ms: float | None = None) -> int:
    """The due time of a retry copy; a copy without one is due now (the worker decided to retry:
    retry now rather than drop). One due later than the lanes keep payloads (not written by a worker)
    is held for the longest tier from when it was written (`written_ms`, the record's timestamp; now
    when it has none, or one ahead of this clock), not for ever: it would pin its partition's committed
    offset. Counted from its writing, the same copy read again (a restart, a rebalance) is due at the
    same time, not 12 h after each read."""
    try:
        due = int(headers["due_at_ms"])
    except (KeyError, ValueError):
        log.warning("retry message %s has no usable due_at_ms; re-publishing now", where)
        return 0
    if due > now_ms + LATEST_DUE_MS:
        log.warning("retry message %s is due later than the lanes keep payloads; holding it for the longest tier",
                    where)
        since = min(written_ms, now_ms) if written_ms and written_ms > 0 else now_ms
        return int(since + max(RETRY_TIERS.values()) * 1000)
    return due


def attempts_made(held: Held) -> int:
    """The attempts a retry copy's send has had: its `attempt` header is the attempt the copy is for."""
    try:
        return max(0, int(held.headers.get("attempt", b"1")) - 1)
    except (TypeError, ValueError):
        return 0


class Retrier:
    def __init__(self, cfg: RetrierConfig, clock: Callable[[], float] = time.time):
        self.cfg = cfg
        self.clock = clock
        self.lane_topic = cfg.names.lane(cfg.channel, cfg.lane)
        self.consumer = lane_consumer(cfg.bootstrap, cfg.group, cfg.commit_interval_ms)
        self.writer = AckedWriter(durable_producer(cfg.bootstrap, **{"message.timeout.ms": cfg.delivery_timeout_ms}),
                                  f"retrier.{cfg.channel}.{cfg.lane}")
        self.tracker = OffsetTracker()
        self.heap: list[Held] = []
        # Released to the lane, not acknowledged yet: still held as far as operators are concerned (the metrics).
        self.released: dict[tuple[str, int, int], Held] = {}
        self.assigned: set[tuple[str, int]] = set()
        self.paused: set[Partition] = set()
        self.bound = MemoryBound(cfg.max_held, cfg.max_held_bytes)
        self.loads: dict[Partition, PartitionLoad] = {}  # what the heap holds (messages, bytes), partition by partition
        self.consume_outage = Outage("Kafka (retrier consume)")
        # A poll returned messages not held yet: offsets stored meanwhile (a revoke served in the consume that
        # follows the poll, the exit after that consume raised) stop at what is tracked (`store_offsets`).
        self._untracked = False
        self.running = True
        self._next_metrics_at = 0.0
        self._tier_of = {self.cfg.names.retry(cfg.channel, cfg.lane, t): t for t in RETRY_TIERS}

    def stop(self, *_: object) -> None:
        self.running = False

    def run(self, until: Callable[[], bool] | None = None) -> None:
        self.consumer.subscribe(self.cfg.topics, on_assign=self._on_assign, on_revoke=self._on_revoke,
                                on_lost=self._on_lost)
        try:
            while self.running and not (until and until()):
                self.step()
        finally:
            self.writer.drain(30)
            self._store(past_idle_to_position=not self._untracked)
            commit_now(self.consumer)
            self.consumer.close()

    def step(self) -> None:
        for msg in consume_ready(self.consumer, 500, self._poll_timeout(), self._returned):
            self._hold(msg)
        self._untracked = False
        self._release_due()
        self.writer.poll(0)
        self._store()
        self._bound_memory()
        if time.monotonic() >= self._next_metrics_at:
            self._next_metrics_at = time.monotonic() + 1.0
            self._metrics()

    def _poll_timeout(self) -> float:
        if not self.heap:
            return MAX_POLL_WAIT_S
        return min(MAX_POLL_WAIT_S, max(0.0, self.heap[0].due_ms / 1000 - self.clock()))

    def _hold(self, msg: Any) -> None:
        if msg.error():
            if msg.error().code() != KafkaError._PARTITION_EOF:
                self.consume_outage.failed(time.monotonic(), msg.error())
            return
        self.consume_outage.recovered(time.monotonic())
        if (msg.topic(), msg.partition()) not in self.assigned:
            return  # revoked after the poll returned it (in the consume of the same batch): its new owner reads it
        where = f"{msg.topic()}[{msg.partition()}]@{msg.offset()}"
        try:
            headers = {k: v or b"" for k, v in (msg.headers() or [])}
        except (UnicodeDecodeError, ValueError, TypeError):  # a header name that is not UTF-8
            self.tracker.add(msg.topic(), msg.partition(), msg.offset())
            self._dead_letter_unreadable(msg, where)
            return
        kind, written_ms = msg.timestamp()
        now_ms = self.clock() * 1000
        due = due_time(headers, where, now_ms, None if kind == TIMESTAMP_NOT_AVAILABLE else written_ms)
        held = Held(due, msg.offset(), msg.topic(), msg.partition(), msg.key(), msg.value(), headers, now_ms)
        self.tracker.add(msg.topic(), msg.partition(), msg.offset())
        self._keep(held)

    def _keep(self, held: Held) -> None:
        heapq.heappush(self.heap, held)
        load = self.loads.setdefault((held.topic, held.partition), PartitionLoad())
        load.count, load.size = load.count + 1, load.size + held.size
        load.latest_due_ms = max(load.latest_due_ms, held.due_ms)

    def _release_due(self) -> None:
        now_ms = self.clock() * 1000
        while self.heap and self.heap[0].due_ms <= now_ms:
            held = heapq.heappop(self.heap)
            load = self.loads[(held.topic, held.partition)]
            load.count, load.size = load.count - 1, load.size - held.size
            if not load.count:
                del self.loads[(held.topic, held.partition)]
            if (held.topic, held.partition) not in self.assigned:
                continue  # revoked meanwhile: its new owner reads it again
            self._republish(held, int(now_ms))

    def _republish(self, held: Held, now_ms: int) -> None:
        headers = {**held.headers, "retried_at_ms": str(now_ms).encode()}
        where = (held.topic, held.partition, held.offset)
        self.released[where] = held
        self.writer.write(self.lane_topic, held.value, held.key, headers.items(),
                          on_ack=lambda: self._acknowledged(where),
                          on_refused=lambda err: self._dead_letter_refused(held, now_ms, where, err))
        metrics.RETRIES_REPUBLISHED.labels(self.cfg.channel, self.cfg.lane, self._tier_of.get(held.topic, "?")).inc()

    def _acknowledged(self, where: tuple[str, int, int]) -> None:
        self.released.pop(where, None)
        self.tracker.finish(*where)

    def _letter_headers(self, origin: tuple[str, int, int], now_ms: int) -> dict[str, bytes]:
        """What every dead letter of this retrier says of where it comes from: its lane, the retry record, when."""
        topic, partition, offset = origin
        return {"channel": self.cfg.channel.encode(), "lane": self.cfg.lane.encode(), "origin_topic": topic.encode(),
                "origin_partition": str(partition).encode(), "origin_offset": str(offset).encode(),
                "group": self.cfg.group.encode(), "dead_lettered_at_ms": str(now_ms).encode()}

    def _dead_letter_unreadable(self, msg: Any, where: str) -> None:
        """A copy whose headers cannot be read (no worker writes one): re-published without them, its send's
        attempt and chain would be lost (the lane worker would take it for a stale first attempt and end it
        unseen). It is dead-lettered `malformed` with its payload, as a lane worker does such a message, and a
        send's outcome says so (its status would stay `retrying`, and a replay refuse it as in progress)."""
        log.error("retry message %s has headers that cannot be read (a name that is not UTF-8): dead-lettered "
                  "`malformed`", where)
        held = Held(0, msg.offset(), msg.topic(), msg.partition(), msg.key(), msg.value(), {})
        now_ms = int(self.clock() * 1000)
        send_id = peek_send_id(msg.value())
        headers = {"send_id": send_id, "tenant": _tenant_of(msg.value()), "reason": b"malformed",
                   "detail": b"a header name is not UTF-8",
                   **self._letter_headers((held.topic, held.partition, held.offset), now_ms)}
        without_payload = {**headers, "reason": b"too_large", "reason_detail": b"malformed",
                           "payload_omitted": b"too_large"}

        def refused(err: KafkaError) -> None:  # too large for the DLQ: the origin headers say where it still is
            metrics.DLQ.labels(self.cfg.channel, self.cfg.lane, "too_large").inc()
            self.writer.write(self.cfg.names.dlq, None, send_id or None, without_payload.items(),
                              on_written=lambda partition, offset: self._dead_lettered(held, now_ms, partition,
                                                                                      offset, "too_large"))

        def written(partition: int, offset: int) -> None:
            metrics.DLQ.labels(self.cfg.channel, self.cfg.lane, "malformed").inc()
            self._dead_lettered(held, now_ms, partition, offset, "malformed")

        self.writer.write(self.cfg.names.dlq, msg.value(), send_id or None, headers.items(), on_written=written,
                          on_refused=refused)

    def _dead_letter_refused(self, held: Held, now_ms: int, where: tuple[str, int, int], err: KafkaError) -> None:
        """The lane refused the copy, for its size (the header added here took a record written straight to the
        lane past the lane's limit) or as an invalid record. Sent again it would be refused again, and its
        partition would never move on: the DLQ keeps a letter without the payload, naming the retry record that
        holds it, and why the lane refused it."""
        for_size = err.code() in (KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE)
        log.error("the lane refused the retry copy at %s[%d]@%d (%s): dead-lettered without its payload", *where,
                  err.name())
        self.released.pop(where, None)
        headers = {k: v[:1000] for k, v in held.headers.items() if k in OWN_DLQ_HEADERS}
        reason = "too_large" if for_size else "malformed"
        detail = b"lane_copy_too_large" if for_size else f"lane_refused:{err.name()}".encode()
        headers.update({"reason": reason.encode(), "reason_detail": detail,
                        "attempts": str(attempts_made(held)).encode(),
                        "payload_omitted": b"too_large" if for_size else b"refused",
                        **self._letter_headers(where, now_ms)})
        metrics.DLQ.labels(self.cfg.channel, self.cfg.lane, reason).inc()
        self.writer.write(self.cfg.names.dlq, None, plausible_send_id(held.headers.get("send_id")) or None,
                          headers.items(), on_written=lambda partition, offset: self._dead_lettered(
                              held, now_ms, partition, offset, reason))

    def _dead_lettered(self, held: Held, now_ms: int, partition: int, offset: int, reason: str) -> None:
        """The send's outcome, as a worker writes one for its dead letters: its status store then shows it
        dead-lettered (and where the letter is), so it can be replayed. The retry record is finished once
        that is acknowledged too."""
        where = (held.topic, held.partition, held.offset)
        try:
            send = decode(held.value)
        except MalformedEvent as exc:
            if exc.send is None:
                self.tracker.finish(*where)  # not a send: nothing has a status to change
                return
            send = exc.send  # a send whose payload is refused: its status says dead-lettered too
        event = {**outcome_event(send, "dropped" if send.channel == "webhook" else "dead_lettered", attempts_made(held),
                                 now_ms, "", reason=reason),
                 "origin": {"topic": held.topic, "partition": held.partition, "offset": held.offset},
                 "dlq": {"partition": partition, "offset": offset}}
        metrics.SENDS.labels(self.cfg.channel, self.cfg.lane, "dead_lettered").inc()
        # The retry record is finished once every record it caused is acknowledged.
        acked = after_all(2 if send.channel == "webhook" else 1, lambda: self.tracker.finish(*where))
        self.writer.write(self.cfg.names.outcomes, orjson.dumps(event), send.send_id.encode(), on_ack=acked)
        if send.channel == "webhook":  # dropped without an attempt of this copy: its tenant's members hear of it
            key, attempt = attempt_event(send, dropped_unattempted(attempts_made(held), now_ms, reason))
            self.writer.write(self.cfg.names.webhook_attempts, orjson.dumps(attempt), key, on_ack=acked)

    def _held(self) -> tuple[int, int]:
        """Messages held and their bytes. Released copies the lane has not acknowledged yet are held too
        (in the writer, payload and all)."""
        held_bytes = sum(load.size for load in self.loads.values())
        return len(self.heap) + self.writer.pending, held_bytes + self.writer.pending_bytes

    def _bound_memory(self) -> None:
        wanted = self.bound.paused(*self._held(), self.assigned, self.paused, self._far(), self.loads)
        if wanted == self.paused:
            return
        if wanted - self.paused:
            log.warning("holding %d retry messages (%d bytes): pausing %d of %d partitions (those holding "
                        "messages due late, or past twice the bound more than their share) until half are released",
                        *self._held(), len(wanted), len(self.assigned))
            self.consumer.pause([TopicPartition(t, p) for t, p in wanted - self.paused])
        if self.paused - wanted:
            self.consumer.resume([TopicPartition(t, p) for t, p in (self.paused - wanted) & self.assigned])
        self.paused = wanted

    def _far(self) -> dict[Partition, PartitionLoad]:
        return far_loads(self.loads, self.clock() * 1000)

    def _returned(self) -> None:
        self._untracked = True

    def _store(self, past_idle_to_position: bool = True) -> None:
        store_offsets(self.consumer, self.tracker, self.assigned, past_idle_to_position)

    def _metrics(self) -> None:
        """Held and overdue, tier by tier: what waits here and what was released and the lane has not
        acknowledged (the lane unwritable: those copies are held, and as overdue as they get)."""
        now_ms = self.clock() * 1000
        by_tier: dict[str, tuple[int, float]] = {t: (0, 0.0) for t in RETRY_TIERS}
        for h in itertools.chain(self.heap, self.released.values()):
            tier = self._tier_of.get(h.topic)
            if tier is not None:
                count, overdue = by_tier[tier]
                # Due before it was read (due now for want of a due time, or read late): overdue from its reading.
                by_tier[tier] = (count + 1, max(overdue, (now_ms - max(h.due_ms, h.read_ms)) / 1000))
        for tier, (count, overdue) in by_tier.items():
            metrics.RETRY_HELD.labels(self.cfg.channel, self.cfg.lane, tier).set(count)
            metrics.RETRY_OVERDUE.labels(self.cfg.channel, self.cfg.lane, tier).set(max(0.0, overdue))

    # ------------------------------------------------------------------ rebalance
    def _on_assign(self, consumer: Any, partitions: list) -> None:
        # Set each new partition's state explicitly: librdkafka may keep a pause flag from before (assigned first, or
        # the pause of a new consumer's partitions would not hold).
        assign_in_callback(consumer, partitions)
        self.assigned |= {(p.topic, p.partition) for p in partitions}
        if partitions:  # a new partition holds nothing here yet: it is read unless nothing more may be
            full = self.bound.full(*self._held(), self._far())
            if full:
                self.paused |= {(p.topic, p.partition) for p in partitions}
            (consumer.pause if full else consumer.resume)(partitions)

    def _on_revoke(self, consumer: Any, partitions: list) -> None:
        self.writer.drain(30)
        # Served inside the consume after a poll, the consumer's position is past a message that poll returned
        # and that is not held yet (it is dropped: its new owner reads it): store what is tracked, not beyond.
        self._store(past_idle_to_position=not self._untracked)
        commit_now(consumer)
        self._on_lost(consumer, partitions)

    def _on_lost(self, consumer: Any, partitions: list) -> None:
        gone = {(p.topic, p.partition) for p in partitions}
        self.assigned -= gone
        self.paused -= gone
        for tp in gone:
            self.tracker.forget(*tp)
            self.loads.pop(tp, None)
        self.released = {w: h for w, h in self.released.items() if w[:2] not in gone}  # its new owner's now
        kept = [h for h in self.heap if (h.topic, h.partition) not in gone]
        if len(kept) != len(self.heap):
            self.heap = kept
            heapq.heapify(self.heap)


def _tenant_of(value: bytes | None) -> bytes:
    """The tenant a copy's send names, as every dead letter's `tenant` header says it (b"": none it can name)."""
    try:
        return decode(value).tenant_id.encode()
    except MalformedEvent as exc:
        return exc.send.tenant_id.encode() if exc.send is not None else b""
