"""Why a lane worker's partitions are paused, and which are.

Reasons: `yield` (a marketing lane while the transactional lane's lag is high), `no_reading` (a
marketing lane without a fresh reading of that lag: it sends nothing, so it reads nothing either) and
`backpressure` (the worker's tenant queues are full). librdkafka keeps an application's pause flag on its
partition object, so a partition revoked while paused and later assigned again could stay paused
for good, and a new assignment could start paused or not: on every assignment each partition's
state is set explicitly from the current reasons (paused, or resumed). The consumer keeps polling
while paused (heartbeats, rebalances, max.poll.interval.ms).

Yielding follows `notif.lag`; when the monitor's reading is stale the lag is measured directly
from the cluster on a background thread (at most once a second), never silently taken as zero,
and never on the poll thread.
"""

from __future__ import annotations

import logging
import time

import orjson
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from .. import metrics
from ..kafka_client import client_config
from ..lag.reader import BackgroundLagRead
from ..lag.yield_policy import Governor, LagReading, YieldPolicy
from ..names import TopicNames, lag_key

log = logging.getLogger("streams.pauses")


class LanePauses:
    def __init__(self, consumer: Consumer, bootstrap: str, names: TopicNames, channel: str, lane: str,
                 policy: YieldPolicy | None):
        self.consumer = consumer
        self.channel = channel
        self._label = (channel, lane)
        # A marketing lane starts without a reading: a partition assigned before its first one starts paused.
        self.reasons: set[str] = {"no_reading"} if policy else set()
        self.paused: set[tuple[str, int]] = set()
        self.assigned: set[tuple[str, int]] = set()
        self.governor = Governor(policy) if policy else None
        self._follower: Consumer | None = None
        self._direct: BackgroundLagRead | None = None
        self._monitor_ts_ms = 0  # the newest reading the monitor published
        if self.governor:
            self._follower = Consumer(client_config(bootstrap, quiet=True, settings={
                "group.id": names.lag_follower_group(channel, lane), "enable.auto.commit": False}))
            self._follower.assign([TopicPartition(names.lag, 0, OFFSET_BEGINNING)])
            self._direct = BackgroundLagRead(bootstrap, names.group(channel, "transactional"),
                                             names.lane(channel, "transactional"))

    @property
    def yielding(self) -> bool:
        return "yield" in self.reasons

    @property
    def without_reading(self) -> bool:
        """A yielding lane must not run blind: with no fresh lag reading (none yet, or only an old one, as the
        first one read back from the compacted topic, or when the monitor and the direct reads both fail) it
        sends nothing until it has one."""
        return self.governor is not None and self.governor.stale(int(time.time() * 1000))

    def on_assign(self, partitions) -> None:
        """Set every newly assigned partition's state from the reasons: paused, or resumed."""
        tps = {(p.topic, p.partition) for p in partitions}
        self.assigned |= tps
        if not partitions:
            return
        if self.reasons:
            self.consumer.pause(partitions)
            self.paused |= tps
        else:
            self.consumer.resume(partitions)
            self.paused -= tps
        self._metrics()

    def forget(self, gone: set[tuple[str, int]]) -> None:
        self.assigned -= gone
        self.paused -= gone
        self._metrics()

    def backpressure(self, buffered: int, limit: int, buffered_bytes: int = 0, bytes_limit: int | None = None) -> None:
        """Pause every partition when the buffer holds `limit` messages or `bytes_limit` bytes of them (large
        sends fill memory long before the count does), until both are down to half."""
        full_bytes = bytes_limit is not None and buffered_bytes >= bytes_limit
        if buffered >= limit or full_bytes:
            if "backpressure" not in self.reasons:
                metrics.BACKPRESSURE_PAUSES.labels(*self._label).inc()
                log.warning("buffer full (%d messages, %d MiB): pausing every partition until half is sent",
                            buffered, buffered_bytes // 2**20)
            self.reasons.add("backpressure")
        elif buffered <= limit // 2 and (bytes_limit is None or buffered_bytes <= bytes_limit // 2):
            self.reasons.discard("backpressure")

    def follow_lag(self) -> None:
        governor = self.governor
        if governor is None or self._follower is None or self._direct is None:
            return
        key = lag_key(self.channel).encode()
        now_ms = int(time.time() * 1000)
        for msg in self._follower.consume(num_messages=100, timeout=0):
            if msg.error() or msg.key() != key or not msg.value():
                continue
            try:
                doc = orjson.loads(msg.value())
                reading = LagReading(int(doc["lag_messages"]), float(doc["lag_seconds"]), int(doc["ts"]))
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, OverflowError):
                log.warning("ignoring an unreadable lag reading at %s@%d", msg.topic(), msg.offset())
                continue
            if not governor.observe(reading, now_ms):
                log.warning("ignoring a lag reading stamped %.1f s ahead of this worker's clock at %s@%d",
                            (reading.ts_ms - now_ms) / 1000, msg.topic(), msg.offset())
            else:
                self._monitor_ts_ms = max(self._monitor_ts_ms, min(reading.ts_ms, now_ms))  # as the governor ages it
        direct = self._direct.take()
        if direct is not None:
            governor.observe(direct, now_ms)
        if governor.aging(now_ms):  # the monitor is silent: measure the lag ourselves rather than run blind or stall
            self._direct.request()
        if governor.stale(now_ms):  # sending nothing, it reads nothing either (it would only park what it reads)
            self.reasons.add("no_reading")
        else:
            self.reasons.discard("no_reading")
        # This worker's clock stepped back: the last reading followed is as old as now, not from the future (or the
        # gauge said fresh while every reading was refused as stamped ahead, until the clock was back at it).
        self._monitor_ts_ms = min(self._monitor_ts_ms, now_ms)
        monitor_silent = now_ms - self._monitor_ts_ms > governor.policy.stale_after_s * 1000
        metrics.LAG_READING_STALE.labels(self.channel).set(1 if monitor_silent else 0)
        self._decide(governor, now_ms)

    def _decide(self, governor: Governor, now_ms: int) -> None:
        reading = governor.reading
        if reading is not None:
            metrics.LAG_READING_AGE.labels(self.channel).set((now_ms - reading.ts_ms) / 1000)
        lag = reading.lag_messages if reading else 0
        if governor.decide(now_ms):
            if not self.yielding:
                log.info("transactional lag %d: marketing yields", lag)
            self.reasons.add("yield")
        elif self.yielding:
            log.info("transactional lag %d: marketing resumes", lag)
            self.reasons.discard("yield")

    def apply(self) -> None:
        """Make the partitions' paused state match the reasons."""
        if self.reasons:
            todo = self.assigned - self.paused
            if todo:
                self.consumer.pause([TopicPartition(t, p) for t, p in todo])
                self.paused |= todo
        elif self.paused:
            self.consumer.resume([TopicPartition(t, p) for t, p in self.paused])
            self.paused = set()
        self._metrics()

    def _metrics(self) -> None:
        for reason in ("yield", "backpressure", "no_reading"):
            metrics.PAUSED.labels(*self._label, reason).set(1 if reason in self.reasons else 0)
        metrics.PAUSED_PARTITIONS.labels(*self._label).set(len(self.paused & self.assigned))
        metrics.ASSIGNED_PARTITIONS.labels(*self._label).set(len(self.assigned))

    def close(self) -> None:
        if self._follower is not None:
            self._follower.close()
        if self._direct is not None:
            self._direct.close()
