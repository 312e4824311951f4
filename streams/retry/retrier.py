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

from confluent_kafka import KafkaError, TopicPartition

from .. import metrics
from ..kafka_client import commit_now, durable_producer, lane_consumer, produce, store_offsets
from ..lanes import RETRY_TIERS
from ..names import TopicNames
from ..offsets import OffsetTracker

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
        return self.names.retry_group(self.channel, self.lane, self.tier)


class Retrier:
    def __init__(self, cfg: RetrierConfig, clock=time.time):
        if cfg.tier not in RETRY_TIERS:
            raise ValueError(f"unknown tier {cfg.tier!r} (tiers: {', '.join(RETRY_TIERS)})")
        self.cfg = cfg
        self.clock = clock
        self.lane_topic = cfg.names.lane(cfg.channel, cfg.lane)
        # Offsets are stored only once the copy in the lane topic is acknowledged.
        self.consumer = lane_consumer(cfg.bootstrap, cfg.group, cfg.commit_interval_ms)
        self.producer = durable_producer(cfg.bootstrap)
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
            commit_now(self.consumer)
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
        produce(self.producer, self.lane_topic, msg.value(), key=msg.key(), headers=headers.items(),
                on_delivery=on_delivery)
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
        store_offsets(self.consumer, self.tracker, self.assigned)

    def _on_assign(self, consumer, partitions) -> None:
        self.assigned |= {(p.topic, p.partition) for p in partitions}

    def _on_revoke(self, consumer, partitions) -> None:
        self.producer.flush(30)
        self._store()
        commit_now(consumer)
        self._on_lost(consumer, partitions)

    def _on_lost(self, consumer, partitions) -> None:
        for p in partitions:
            tp = (p.topic, p.partition)
            self.assigned.discard(tp)
            self.waiting.pop(tp, None)
            self.tracker.forget(*tp)
