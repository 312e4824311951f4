"""Reading a consumer group's lag from the cluster (confluent-kafka Consumer adapter).

Lag in messages = sum over partitions of (log-end offset - committed offset), each clamped at
zero: the two offsets are not read atomically, so a commit landing in between could otherwise
make it negative. A group without a commit counts from the earliest offset. Lag in seconds is
the age of the oldest unconsumed message (its timestamp at the committed offset).

Only Consumer calls are used (`committed`, `get_watermark_offsets`, `list_topics`), through a
consumer that carries the group's id but never joins it. The AdminClient's
`list_consumer_group_offsets` is avoided on purpose: while requests time out during a broker
outage it can abort the whole process (librdkafka issues #4605 and #3663).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from ..errors import BrokerUnavailable, StackError
from ..kafka_client import client_config, described_partitions
from .yield_policy import LagReading

TIMEOUT_S = 5.0
PARTITIONS_TTL_S = 60.0
PEEK_S = 1.0  # how long a read waits for the waiting messages' heads (their timestamps give the lag's age)
HEAD_KEPT_S = 30.0  # see KeptHeads
log = logging.getLogger("streams.lag")
# A head peeker's fetches keep librdkafka's sizes (1 MiB a partition): a smaller bound saves nothing on a blast's
# backlog, whose record batches are larger (the broker returns an oversized first batch whole only for the first
# partition of a fetch, the others then take a fetch each, one after the other).
PEEKER_SETTINGS = {"enable.auto.commit": False, "fetch.wait.max.ms": 10, "enable.partition.eof": True,
                   "auto.offset.reset": "earliest"}  # a head deleted since its position was read: the oldest left


def head_peeker(bootstrap: str, group: str, settings: dict[str, Any] | None = None) -> Consumer:
    """A consumer that reads the first waiting message of partitions it is assigned (never subscribes or commits:
    `group` only names it). `settings`: more librdkafka settings over these (a test's statistics)."""
    return Consumer(client_config(bootstrap, quiet=True, settings={**PEEKER_SETTINGS, "group.id": group,
                                                                   **(settings or {})}))


Head = TypeVar("Head")


class KeptHeads(Generic[Head]):
    """What was read of partitions' first waiting messages (a timestamp, a due time), kept while the group's position
    on the partition stays where it was (a lane paused, a retry tier waiting for its first copy's due time, or
    between two commits): the first message at or past a position never changes, and each fetch of it brings up to
    a megabyte of the backlog behind it. Read again after HEAD_KEPT_S all the same (a topic deleted and made anew
    counts its offsets from 0 again). A partition whose end was reached without a message has nothing kept."""

    def __init__(self) -> None:
        self._heads: dict[tuple[str, int], tuple[int, Head, float]] = {}  # -> (position, what was read, when)

    def read(self, topic: str, positions: dict[int, int],
             fetch: Callable[[dict[int, int]], dict[int, Head]]) -> dict[int, Head]:
        """The heads of the topic's partitions at these positions (partition -> position): those kept, and `fetch`
        of the others (which leaves out a partition whose end it reached without a message), kept from now on.
        What was kept of the topic's other partitions or positions is forgotten."""
        now = time.monotonic()
        kept = {p: head[1] for p, position in positions.items()
                if (head := self._heads.get((topic, p))) is not None
                and head[0] == position and now - head[2] < HEAD_KEPT_S}
        for key in [k for k in self._heads if k[0] == topic and k[1] not in kept]:
            del self._heads[key]
        fetched = fetch({p: position for p, position in positions.items() if p not in kept})
        for p, value in fetched.items():
            self._heads[topic, p] = (positions[p], value, now)
        return {**kept, **fetched}


class LagReader:
    def __init__(self, bootstrap: str):
        self.bootstrap = bootstrap
        self._offsets: dict[str, Consumer] = {}  # group -> a consumer that reads its committed offsets
        self.peeker = head_peeker(bootstrap, f"lag-reader-peek-{uuid.uuid4().hex[:8]}")
        self._partitions: dict[str, tuple[float, list[int]]] = {}  # topic -> (listed at, its partitions)
        self.heads: KeptHeads[int] = KeptHeads()  # the heads' timestamps

    def _consumer(self, group: str) -> Consumer:
        if group not in self._offsets:
            # Never subscribes: it only fetches the group's committed offsets, without joining it.
            self._offsets[group] = Consumer(client_config(self.bootstrap, quiet=True, settings={
                "group.id": group, "enable.auto.commit": False, "enable.auto.offset.store": False}))
        return self._offsets[group]

    def partitions(self, topic: str) -> list[int]:
        """The topic's partitions, listed again every PARTITIONS_TTL_S: partitions added at run time (`streams
        topics apply`) count in the lag within a minute, not at the reader's next restart."""
        cached = self._partitions.get(topic)
        if cached is None or time.monotonic() - cached[0] > PARTITIONS_TTL_S:
            try:
                cached = (time.monotonic(), described_partitions(self.peeker, topic, TIMEOUT_S))
            except (KafkaException, BrokerUnavailable) as exc:
                if cached is None:
                    raise StackError(f"cannot read lag: topic {topic} ({exc})") from None
                # Known already: keep reading those (a broker restarting answers metadata with errors for a
                # while), and list them again in a minute, not on every read.
                cached = (time.monotonic(), cached[1])
            self._partitions[topic] = cached
        return cached[1]

    def positions(self, group: str, topic: str, complete: bool = True) -> dict[int, tuple[int, int]]:
        """Per partition: (the group's position, the log-end offset). A partition without a commit, or
        whose commit is outside the log, is positioned at its earliest offset. One whose commit came back with an
        error (it reads as "no commit", offset -1001: its whole log would be taken for lag) fails the read, or, when
        not `complete`, is left out (a caller that needs only some partitions)."""
        consumer = self._consumer(group)
        partitions = self.partitions(topic)
        parts = [TopicPartition(topic, p) for p in partitions]
        answered = consumer.committed(parts, timeout=TIMEOUT_S)
        failed = [tp for tp in answered if tp.error is not None]
        if failed and complete:
            raise KafkaException(failed[0].error)
        unknown = {tp.partition for tp in failed}
        committed = {tp.partition: tp.offset for tp in answered}
        out = {}
        for p in partitions:
            if p in unknown:
                continue
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=TIMEOUT_S, cached=False)
            position = committed.get(p, -1)
            # Outside the log (none committed; deleted by retention; the topic made anew under the group's old
            # offsets) the group's consumers start at the earliest offset, and so does its lag: never clamped to 0.
            out[p] = (position if low <= position <= high else low, high)
        return out

    def read(self, group: str, topic: str, source: str = "monitor") -> LagReading:
        # Stamped when the read began: offsets read over seconds of a slow broker are no fresher than the first
        # of them, and a reading stamped at its end would be trusted for its whole stale age past that.
        started_ms = int(time.time() * 1000)
        try:
            positions = self.positions(group, topic)
            lag = sum(max(0, high - pos) for pos, high in positions.values())
            heads = [TopicPartition(topic, p, pos) for p, (pos, high) in positions.items() if high > pos]
            oldest_ts = self._oldest_timestamp(heads)
        except KafkaException as exc:
            raise StackError(f"cannot read the lag of {group} on {topic}: {exc}") from None
        lag_s = max(0.0, (time.time() * 1000 - oldest_ts) / 1000) if oldest_ts else 0.0
        return LagReading(lag, lag_s, started_ms, source)

    def _oldest_timestamp(self, heads: list[TopicPartition]) -> int | None:
        """Timestamp of the oldest message among the partitions' first unconsumed ones. A partition whose end
        is reached without a message (only a transaction's marker was left, or an open transaction's records
        no worker can read yet) has none. StackError when a head could not be fetched in time: the age is then
        unknown, not 0 or a younger partition's (which would let marketing run while OTPs wait). A head read
        before at the same position is not fetched again (KeptHeads)."""
        if not heads:
            return None
        topic = heads[0].topic
        found = self.heads.read(topic, {tp.partition: tp.offset for tp in heads},
                                lambda positions: self._fetch_heads(topic, positions))
        return min(found.values()) if found else None

    def _fetch_heads(self, topic: str, positions: dict[int, int]) -> dict[int, int]:
        """Per partition, the timestamp of the first message at or past its position (none: its end reached)."""
        if not positions:
            return {}
        heads = [TopicPartition(topic, p, position) for p, position in positions.items()]
        self.peeker.assign(heads)
        found: dict[int, int] = {}
        ended: set[int] = set()
        deadline = time.monotonic() + PEEK_S
        try:
            while len(found) + len(ended) < len(heads) and time.monotonic() < deadline:
                for m in self.peeker.consume(num_messages=len(heads) * 4, timeout=0.1):
                    if m.partition() in found:
                        continue
                    if not m.error():
                        # A partition ended before may have a message now (its head was an open transaction's
                        # record): counted once, or the loop stops before a partition holding an older one.
                        found[m.partition()] = m.timestamp()[1]
                        ended.discard(m.partition())
                    elif m.error().code() == KafkaError._PARTITION_EOF:
                        ended.add(m.partition())
        finally:
            self.peeker.unassign()
        if len(found) + len(ended) < len(heads):  # a partition not read could hold the oldest message
            raise StackError(f"cannot read the age of the lag: the waiting messages of {len(heads) - len(found)} "
                             f"partition(s) of {heads[0].topic} could not be fetched within {PEEK_S:g} s")
        return found

    def close(self) -> None:
        for c in self._offsets.values():
            c.close()
        self.peeker.close()


class BackgroundLagRead:
    """Measures one group's lag on a thread of its own, when asked and at most once per
    `every_s`, so a slow or failing cluster never stalls the caller's poll loop. The caller asks
    with `request()` and picks up the latest reading with `take()`."""

    def __init__(self, bootstrap: str, group: str, topic: str, every_s: float = 1.0):
        self.bootstrap, self.group, self.topic, self.every_s = bootstrap, group, topic, every_s
        self._wanted = threading.Event()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._reading: LagReading | None = None
        self._thread: threading.Thread | None = None

    def request(self) -> None:
        if self._thread is None or not self._thread.is_alive():  # started, or started again after a crash
            self._thread = threading.Thread(target=self._run, name=f"lag-read-{self.group}", daemon=True)
            self._thread.start()
        self._wanted.set()

    def take(self) -> LagReading | None:
        with self._lock:
            reading, self._reading = self._reading, None
        return reading

    def _run(self) -> None:
        try:
            reader = LagReader(self.bootstrap)
        except Exception:  # noqa: BLE001 - the next request() starts the thread again
            log.exception("cannot start the direct lag reader")
            self._stopping.wait(self.every_s)
            return
        try:
            while not self._stopping.is_set():
                if not self._wanted.wait(timeout=0.5):
                    continue
                self._wanted.clear()
                try:
                    reading = reader.read(self.group, self.topic, source="direct")
                    with self._lock:
                        self._reading = reading
                except StackError as exc:
                    log.warning("direct lag read failed: %s", exc)
                except Exception:  # noqa: BLE001 - a failure no check foresaw must not end the reads for good
                    log.exception("direct lag read failed unexpectedly")
                self._stopping.wait(self.every_s)  # at most one read per interval
        finally:
            reader.close()

    def close(self) -> None:
        self._stopping.set()
        self._wanted.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
