"""`streams lag-monitor`: publishes each channel's transactional lag to the compacted `notif.lag`
topic (key `{channel}.transactional`) and both lanes' lag to Prometheus, every <= 500 ms.

Several copies may run: each publishes a fresh measurement of the same quantity and the latest
one wins (compaction keeps one value per key), so extra copies change nothing but load.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

import orjson
from confluent_kafka import KafkaException, Producer

from .. import metrics
from ..backoff import Outage
from ..kafka_client import client_config, produce
from ..lanes import CHANNELS, LANES
from ..names import TopicNames, lag_key
from .reader import LagReader
from .retry_watch import RetryTierWatch
from .yield_policy import LagReading

log = logging.getLogger("streams.lag_monitor")
MAX_INTERVAL_S = 0.5


class LagMonitor:
    def __init__(self, bootstrap: str, names: TopicNames | None = None, channels=CHANNELS,
                 interval_s: float = 0.25, retry_watch_every_s: float = 5.0):
        if not 0 < interval_s <= MAX_INTERVAL_S:
            raise ValueError(f"interval must be in (0, {MAX_INTERVAL_S}] s, got {interval_s}")
        self.names = names or TopicNames()
        self.channels = channels
        self.interval_s = interval_s
        # A reader and a thread per lane: one lane slow to read (its group's coordinator away, a partition without
        # a leader: seconds per call) holds back only its own readings, not every channel's.
        self.readers = {(channel, lane): LagReader(bootstrap) for channel in channels for lane in LANES}
        self._pool = ThreadPoolExecutor(len(self.readers), thread_name_prefix="lag-read")
        self._reading: dict[tuple[str, str], Future[LagReading]] = {}
        # A reading is worth publishing only while fresh: a short delivery timeout, no retry of old ones.
        self.producer = Producer(client_config(bootstrap, settings={"acks": "all", "linger.ms": 0,
                                                                    "message.timeout.ms": 5000}))
        self.running = True
        self._failing: set[tuple[str, str]] = set()
        self.publish_outage = Outage("Kafka (notif.lag writes)")
        self.retry_watch = RetryTierWatch(bootstrap, self.names, tuple(channels), every_s=retry_watch_every_s)
        started = time.time()
        for channel in channels:  # a channel it never manages to publish goes stale from its start, not never
            metrics.LAG_MONITOR_LAST_PUBLISH.labels(channel).set(started)

    def stop(self, *_: object) -> None:
        self.running = False

    def tick(self) -> None:
        """Start a reading of each lane not being read, and take those done within an interval."""
        for (channel, lane), reader in self.readers.items():
            if (channel, lane) not in self._reading:
                self._reading[channel, lane] = self._pool.submit(
                    reader.read, self.names.group(channel, lane), self.names.lane(channel, lane))
        wait(self._reading.values(), timeout=self.interval_s)
        for (channel, lane), reading in list(self._reading.items()):
            if reading.done():
                del self._reading[channel, lane]
                self._take(channel, lane, reading)
        self.producer.poll(0)

    def _take(self, channel: str, lane: str, future: Future[LagReading]) -> None:
        try:
            reading = future.result()
        except Exception as exc:  # noqa: BLE001 - a missing topic must not stop the others
            if (channel, lane) not in self._failing:  # say it once, not every tick
                log.warning("lag of %s.%s unavailable: %s", channel, lane, exc)
                self._failing.add((channel, lane))
                # No reading is shown as none, not as the last one frozen (often 0): the channel's
                # publication timestamp goes stale, and LagMonitorStale names the channel.
                metrics.LANE_LAG_MESSAGES.remove(channel, lane)
                metrics.LANE_LAG_SECONDS.remove(channel, lane)
            return
        if (channel, lane) in self._failing:
            log.info("lag of %s.%s available again", channel, lane)
            self._failing.discard((channel, lane))
        metrics.LANE_LAG_MESSAGES.labels(channel, lane).set(reading.lag_messages)
        metrics.LANE_LAG_SECONDS.labels(channel, lane).set(reading.lag_seconds)
        if lane != "transactional":
            return
        value = {"lag_messages": reading.lag_messages, "lag_seconds": reading.lag_seconds, "ts": reading.ts_ms}
        try:
            produce(self.producer, self.names.lag, orjson.dumps(value), key=lag_key(channel).encode(),
                    on_delivery=lambda err, msg: self._published(channel, err, reading.ts_ms))
        except KafkaException as exc:  # refused at once: notif.lag missing, or denied by an ACL
            # As a failed publication (the channel goes stale, LagMonitorStale names it); the lanes' lag on /metrics
            # and the retry tiers' watch go on (raising stopped them all, at every restart, before the first reading).
            self._published(channel, exc.args[0], reading.ts_ms)

    def _published(self, channel: str, err, ts_ms: int) -> None:
        """The monitor is only as fresh as its last *acknowledged* reading, channel by channel: a monitor that
        cannot read a channel's lag (its group's coordinator away, a topic it may not read) or write it goes
        stale for that channel, and the LagMonitorStale alert names it. Stamped when the reading was taken, as
        workers judge it: one acknowledged 4 s late (a broker slow to replicate) is 4 s old, not fresh."""
        if err is None:
            self.publish_outage.recovered(time.monotonic())
            metrics.LAG_MONITOR_LAST_PUBLISH.labels(channel).set(ts_ms / 1000)
        else:
            self.publish_outage.failed(time.monotonic(), err)

    def run(self, until=None) -> None:
        self.retry_watch.start()
        next_tick = time.monotonic()
        try:
            while self.running and not (until and until()):
                self.tick()
                next_tick += self.interval_s
                # Only this process's own loop waits here; it consumes nothing.
                time.sleep(max(0.0, next_tick - time.monotonic()))
                next_tick = max(next_tick, time.monotonic())
        finally:
            self.retry_watch.close()
            self.producer.flush(10)
            self._pool.shutdown(wait=True)  # a reader is closed only once no read of it runs
            for reader in self.readers.values():
                reader.close()
