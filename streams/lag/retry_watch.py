"""Watching the retry tiers (part of `streams lag-monitor`): for every lane's tiers, how many messages
wait to be released, and how far past its due time the most overdue of them is.

A retrier that died, stalled or lost its partitions shows here, from the outside: its tier's
messages go overdue (`dispatch_retry_tier_overdue_seconds`, alert RetryTierStuck). The count is the
retry group's committed lag; the overdue time comes from the `due_at_ms` header of the message at each
partition's committed position: the lowest one its retrier has not released (everything before it was).
The messages after it say nothing: a retrier releases by due time (each copy's delay has its own
jitter, and a long tier's copies fall due out of order by hours), so they may be released already while
the committed offset waits for the head. It runs on a thread of its own, every few seconds, so the
transactional lag keeps its 500 ms rhythm. A tier it cannot read exports for how long instead
(`dispatch_retry_tier_unreadable_seconds`, alert RetryTierUnwatched): a stuck tier would not show. With the
webhook channel it also says how far behind the endpoint-health app is on the webhook attempts
(`dispatch_endpoint_health_behind_seconds`, alert EndpointHealthBehind), and on every channel how far behind the
outcome recorder is on `notif.outcomes` (`dispatch_outcome_recorder_behind_seconds`, alert OutcomeRecorderBehind);
either one it cannot read, for how long (`dispatch_follower_unreadable_seconds`, alert FollowerUnwatched).
"""

from __future__ import annotations

import logging
import threading
import time

from confluent_kafka import Consumer, KafkaError, TopicPartition
from prometheus_client import Gauge

from .. import metrics
from ..errors import StackError
from ..lanes import LANES, RETRY_TIERS
from ..names import TopicNames
from .reader import KeptHeads, LagReader

log = logging.getLogger("streams.retry_watch")


class RetryTierWatch:
    def __init__(self, bootstrap: str, names: TopicNames, channels: tuple[str, ...], every_s: float = 5.0):
        self.bootstrap, self.names, self.channels = bootstrap, names, channels
        self.every_s = every_s
        self.head_timeout_s = 2.0  # how long a tier's heads may take to read before the tier counts as unreadable
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="retry-tier-watch", daemon=True)
        self._failing_since: dict[str, float] = {}  # what (a topic...): when its read first failed (monotonic)
        self.dues: KeptHeads[float | None] = KeptHeads()  # the due time of each partition's lowest unreleased copy

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=15)

    def _run(self) -> None:
        reader = LagReader(self.bootstrap)
        # The reader's head peeker (used on this thread only, one read after another). A head deleted by retention
        # between the positions' read and the peek is read from the earliest offset left (read from the end, a tier
        # whose copies are being deleted unreleased would show nothing overdue); a position followed only by a
        # transaction's marker has no head to read: the partition's end says so.
        peeker = reader.peeker
        try:
            while not self._stopping.is_set():
                for channel in self.channels:
                    for lane in LANES:
                        for tier in RETRY_TIERS:
                            self._measure(reader, peeker, channel, lane, tier)
                if "webhook" in self.channels:
                    self._measure_endpoint_health(reader)
                self._measure_outcome_recorder(reader)
                self._stopping.wait(self.every_s)
        finally:
            reader.close()

    def _measure(self, reader: LagReader, peeker: Consumer, channel: str, lane: str, tier: str) -> None:
        topic = self.names.retry(channel, lane, tier)
        try:
            positions = reader.positions(self.names.retry_group(channel, lane), topic)
            waiting = sum(max(0, high - pos) for pos, high in positions.values())
            overdue = self._overdue(peeker, topic, positions) if waiting else 0.0
        except Exception as exc:  # noqa: BLE001 - one missing tier must not stop the others, nor the watch
            failing_s = self._failing(topic, f"retry tier {topic} unavailable: {exc}")
            # Not measured: no figure rather than the last one (which could keep paging, or hide a stuck tier),
            # and how long it has not been, so that a tier no one can see into is not silent either.
            for gauge in (metrics.RETRY_TIER_WAITING, metrics.RETRY_TIER_OVERDUE):
                try:
                    gauge.remove(channel, lane, tier)
                except KeyError:  # never measured
                    pass
            metrics.RETRY_TIER_UNREADABLE.labels(channel, lane, tier).set(failing_s)
            return
        self._failing_since.pop(topic, None)
        metrics.RETRY_TIER_UNREADABLE.labels(channel, lane, tier).set(0)
        metrics.RETRY_TIER_WAITING.labels(channel, lane, tier).set(waiting)
        metrics.RETRY_TIER_OVERDUE.labels(channel, lane, tier).set(overdue)

    def _measure_endpoint_health(self, reader: LagReader) -> None:
        """How far behind the endpoint-health app is on the webhook attempts (alert EndpointHealthBehind): stopped,
        endpoints never degrade, members are never told, and reactivations the API accepted do nothing."""
        self._measure_follower(reader, "the endpoint-health app", self.names.endpoint_health_app,
                               self.names.webhook_attempts, metrics.ENDPOINT_HEALTH_BEHIND)

    def _measure_outcome_recorder(self, reader: LagReader) -> None:
        """How far behind the outcome recorder is on the outcomes (alert OutcomeRecorderBehind): stopped, or held
        (Redis out of reach), statuses stay where they were (a delivered send reads `accepted`), while dispatch
        goes on."""
        self._measure_follower(reader, "the outcome recorder", self.names.recorder_group, self.names.outcomes,
                               metrics.OUTCOME_RECORDER_BEHIND)

    def _measure_follower(self, reader: LagReader, who: str, group: str, topic: str, gauge: Gauge) -> None:
        """The age of the oldest record of `topic` that `group` has not consumed, on `gauge` (NaN: not read)."""
        try:
            reading = reader.read(group, topic)
        except Exception as exc:  # noqa: BLE001 - like a tier's: the watch goes on
            failing_s = self._failing(group, f"{who}'s progress cannot be read: {exc}")
            gauge.labels(group).set(float("nan"))  # not measured: no figure, not the last
            # NaN keeps the behind alert silent: how long it has not been read, so that is not silent too.
            metrics.FOLLOWER_UNREADABLE.labels(group).set(failing_s)
            return
        self._failing_since.pop(group, None)
        metrics.FOLLOWER_UNREADABLE.labels(group).set(0)
        gauge.labels(group).set(reading.lag_seconds)

    def _failing(self, subject: str, message: str) -> float:
        """Seconds `subject` has not been read; `message` is logged once, until it is read again."""
        if subject not in self._failing_since:
            log.warning("%s", message)
        return time.monotonic() - self._failing_since.setdefault(subject, time.monotonic())

    def _overdue(self, peeker: Consumer, topic: str, positions: dict[int, tuple[int, int]]) -> float:
        """Seconds past due of the most overdue of the partitions' lowest unreleased messages (the first read
        from each committed position: a transaction's marker there is never returned, the next message is). One read
        before at the same position is not fetched again (KeptHeads: a long tier's retrier waits hours on it)."""
        now_ms = time.time() * 1000
        waiting = {p: pos for p, (pos, high) in positions.items() if high > pos}
        dues = self.dues.read(topic, waiting, lambda unread: self._fetch_dues(peeker, topic, unread)).values()
        return max([0.0, *((now_ms - due) / 1000 for due in dues if due is not None)])

    def _fetch_dues(self, peeker: Consumer, topic: str, positions: dict[int, int]) -> dict[int, float | None]:
        """Per partition, the due time of the first message at or past its position (None: it has none a worker
        writes; left out: the partition's end reached without a message)."""
        if not positions:
            return {}
        ends = {p: pos + 1 for p, pos in positions.items()}
        peeker.assign([TopicPartition(topic, p, pos) for p, pos in positions.items()])
        found: dict[int, float | None] = {}
        deadline = time.monotonic() + self.head_timeout_s
        refused: list[KafkaError] = []
        try:
            while ends and time.monotonic() < deadline:
                for m in peeker.consume(num_messages=len(ends) * 4, timeout=0.1):  # one a partition is enough
                    if m.error():
                        if m.error().code() == KafkaError._PARTITION_EOF:
                            ends.pop(m.partition(), None)  # nothing but markers past the position: no head
                        else:
                            refused.append(m.error())  # e.g. not authorised to read the topic
                        continue
                    if m.partition() not in ends:
                        continue
                    found[m.partition()] = _due_at(m.headers())
                    if m.offset() + 1 >= ends[m.partition()]:
                        ends.pop(m.partition())
        except StackError:
            pass
        finally:
            peeker.unassign()
        if ends:  # heads not reached: not "not overdue" (a stuck tier would look on time), but unreadable
            why = refused[0].str() if refused else f"not given within {self.head_timeout_s:g} s"
            raise StackError(f"cannot read the lowest unreleased message of {topic}: {why}")
        return found


def _due_at(headers: list | None) -> float | None:
    """A copy's due time, when it carries one a worker writes (a number of a few hundred digits is none)."""
    due = dict(headers or []).get("due_at_ms")
    try:
        return float(int(due)) if due else None
    except (ValueError, TypeError, OverflowError):
        return None
