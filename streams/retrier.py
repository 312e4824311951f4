"""The delayed-retry consumer: `streams retrier --channel email --lane marketing --tier 1m`.

A tier has one fixed delay, so in each partition the head is always the message due first. The
retrier re-publishes a due message to its lane topic (the value byte-identical, the headers kept)
and stores its offset only after the broker acknowledged the copy. When the head is not due yet
it pauses *that partition only* and seeks back to the head, so one far-future message never delays
other partitions; it keeps polling while paused (no sleep in the poll loop, no max.poll.interval
breach). A crash between the produce and the commit re-publishes a few messages again: the lane
worker's idempotency absorbs them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from . import metrics
from .kafka_config import client_config
from .lanes import RETRY_TIERS, TopicNames
from .offsets import OffsetTracker

log = logging.getLogger("streams.retrier")


@dataclass(frozen=True)
class RetrierConfig:
    channel: str
    lane: str
    tier: str
    bootstrap: str
    names: TopicNames = TopicNames()
    commit_interval_ms: int = 1000

    @property
    def topic(self) -> str:
        return self.names.retry(self.channel, self.lane, self.tier)

    @property
    def group(self) -> str:
        # Each lane's consumer group owns its retry topics.
        return f"{self.names.group(self.channel, self.lane)}.retry.{self.tier}"


class Retrier:
    def __init__(self, cfg: RetrierConfig, clock=time.time):
        if cfg.tier not in RETRY_TIERS:
            raise ValueError(f"unknown tier {cfg.tier!r} (tiers: {', '.join(RETRY_TIERS)})")
        self.cfg = cfg
        self.clock = clock
        self.lane_topic = cfg.names.lane(cfg.channel, cfg.lane)
        self.consumer = Consumer(client_config(cfg.bootstrap, **{
            "group.id": cfg.group,
            "partition.assignment.strategy": "cooperative-sticky",
            # Offsets are stored only once the copy in the lane topic is acknowledged.
            "enable.auto.offset.store": False,
            "enable.auto.commit": True,
            "auto.commit.interval.ms": cfg.commit_interval_ms,
            "auto.offset.reset": "earliest",
            # A crashed retrier's partitions move to another copy within ~10 s.
            "session.timeout.ms": 10_000,
            "heartbeat.interval.ms": 1_000,
        }))
        self.producer = Producer(client_config(cfg.bootstrap, **{"enable.idempotence": True, "acks": "all"}))
        self.tracker = OffsetTracker()
        self.waiting: dict[tuple[str, int], tuple[int, int]] = {}  # paused partition -> (head offset, due ms)
        self.assigned: set[tuple[str, int]] = set()
        self.running = True

    def stop(self, *_: object) -> None:
        self.running = False

    def run(self, until=None) -> None:
        self.consumer.subscribe([self.cfg.topic], on_assign=self._on_assign, on_revoke=self._on_revoke,
                                on_lost=self._on_lost)
        try:
            while self.running and not (until and until()):
                self.step()
        finally:
            self.producer.flush(30)
            self._store()
            try:
                self.consumer.commit(asynchronous=False)
            except Exception as exc:  # noqa: BLE001 - nothing stored
                log.debug("final commit: %s", exc)
            self.consumer.close()

    def step(self) -> None:
        self._resume_due()
        for msg in self.consumer.consume(num_messages=500, timeout=self._poll_timeout()):
            self._handle(msg)
        self.producer.poll(0)
        self._store()

    def _poll_timeout(self) -> float:
        if not self.waiting:
            return 0.5
        next_due = min(due for _, due in self.waiting.values())
        return min(0.5, max(0.0, next_due / 1000 - self.clock()))

    def _handle(self, msg) -> None:
        if msg.error():
            if msg.error().code() != KafkaError._PARTITION_EOF:
                log.warning("consume error on %s: %s", self.cfg.topic, msg.error())
            return
        tp = (msg.topic(), msg.partition())
        if tp in self.waiting:
            return  # fetched behind a head that is not due: it is read again after the seek
        headers = dict(msg.headers() or [])
        try:
            due_ms = int(headers["due_at_ms"])
        except (KeyError, ValueError):
            due_ms = 0  # no due time: the worker decided to retry, so retry now rather than drop
            log.warning("retry message %s[%d]@%d has no due_at_ms; re-publishing now", *tp, msg.offset())
        if due_ms > self.clock() * 1000:
            self.consumer.pause([TopicPartition(*tp)])
            self.waiting[tp] = (msg.offset(), due_ms)
            return
        self.tracker.add(*tp, msg.offset())
        where = (msg.topic(), msg.partition(), msg.offset())

        def on_delivery(err, _m, where=where) -> None:
            if err is None:
                self.tracker.finish(*where)
            else:
                log.error("re-publishing %s[%d]@%d failed: %s; it will be read again", *where, err)

        headers["retried_at_ms"] = str(int(self.clock() * 1000)).encode()
        while True:
            try:
                self.producer.produce(self.lane_topic, key=msg.key(), value=msg.value(),
                                      headers=list(headers.items()), on_delivery=on_delivery)
                break
            except BufferError:
                self.producer.poll(0.1)
        metrics.RETRIES_REPUBLISHED.labels(self.cfg.channel, self.cfg.lane, self.cfg.tier).inc()

    def _resume_due(self) -> None:
        now_ms = self.clock() * 1000
        for tp, (offset, due) in list(self.waiting.items()):
            if due <= now_ms:
                del self.waiting[tp]
                part = TopicPartition(tp[0], tp[1], offset)
                self.consumer.seek(part)
                self.consumer.resume([TopicPartition(*tp)])

    def _store(self) -> None:
        offsets = [TopicPartition(t, p, o) for (t, p), o in self.tracker.committable().items()
                   if (t, p) in self.assigned]
        if offsets:
            try:
                self.consumer.store_offsets(offsets=offsets)
            except Exception as exc:  # noqa: BLE001 - revoked meanwhile
                log.debug("store_offsets: %s", exc)

    def _on_assign(self, consumer, partitions) -> None:
        self.assigned |= {(p.topic, p.partition) for p in partitions}

    def _on_revoke(self, consumer, partitions) -> None:
        self.producer.flush(30)
        self._store()
        try:
            consumer.commit(asynchronous=False)
        except Exception as exc:  # noqa: BLE001
            log.debug("commit on revoke: %s", exc)
        self._on_lost(consumer, partitions)

    def _on_lost(self, consumer, partitions) -> None:
        for p in partitions:
            tp = (p.topic, p.partition)
            self.assigned.discard(tp)
            self.waiting.pop(tp, None)
            self.tracker.forget(*tp)
