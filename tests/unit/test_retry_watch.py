"""The retry tiers' watch reads how overdue a tier is from the lowest message its retrier has not released (the
committed position's). No broker: a fake peeker returns a partition's messages from the position assigned."""

import time
from types import SimpleNamespace

import pytest

from streams.lag.retry_watch import RetryTierWatch
from streams.names import TopicNames


class Peeker:
    def __init__(self, partitions: dict[int, list[int]]):
        self.partitions = partitions  # partition -> due_at_ms of its messages, by offset
        self.assigned: list = []

    def assign(self, tps):
        self.assigned = [(tp.partition, tp.offset) for tp in tps]

    def consume(self, num_messages=1, timeout=0):
        out = []
        for partition, offset in self.assigned:
            for o, due in enumerate(self.partitions[partition][offset:], start=offset):
                out.append(SimpleNamespace(error=lambda: None, partition=lambda p=partition: p,
                                           offset=lambda o=o: o, headers=lambda d=due: [("due_at_ms", str(d).encode())]))
        self.assigned = []
        return out

    def unassign(self):
        pass


def _overdue(partitions: dict[int, list[int]], positions: dict[int, tuple[int, int]]) -> float:
    watch = RetryTierWatch("127.0.0.1:9", TopicNames(), ("email",))
    return watch._overdue(Peeker(partitions), "notif.email.marketing.retry.1h", positions)  # type: ignore[arg-type]


def test_a_copy_released_before_the_head_of_its_partition_is_not_overdue():
    """On the 1 h tier a copy due in 72 minutes (the head: the retrier holds it, and the committed offset waits for
    it) followed by one due 48 minutes after it was written, released on time: the second is behind the
    committed offset, but it was released. Read as overdue, it paged RetryTierStuck for the 24 minutes between."""
    now = int(time.time() * 1000)
    assert _overdue({0: [0, 0, now + 20 * 60_000, now - 5 * 60_000]}, {0: (2, 4)}) == 0.0


def test_the_head_past_its_due_time_is_overdue():
    now = int(time.time() * 1000)
    overdue = _overdue({0: [now - 90_000, now - 200_000], 1: [now + 1_000]}, {0: (0, 2), 1: (0, 1)})
    assert 89 <= overdue <= 92


def test_a_head_whose_due_time_is_no_number_a_worker_writes_leaves_the_others_read():
    """Given a tier partition whose first copy says it is due at a number of 400 digits (written past dispatch) and
    another whose first copy is 90 s overdue,
    When the watch reads the tier,
    Then it is 90 s overdue (not unreadable, its figures removed, for as long as that copy waits)."""
    now = int(time.time() * 1000)
    assert 89 <= _overdue({0: [10 ** 400], 1: [now - 90_000]}, {0: (0, 1), 1: (0, 1)}) <= 92


def test_a_head_read_before_at_the_same_position_is_not_fetched_again():
    """Given a 12 h tier whose retrier waits on its first copy (due in hours; its position does not move) and another
    partition whose first copy is overdue,
    When the watch reads the tier again (every 5 s), the second partition's retrier having moved on to an overdue
    copy,
    Then only the moved partition's head is fetched (each fetch brings up to a megabyte of the backlog behind it;
    before, every head every 5 s), and the tier reads as overdue as its most overdue head, the kept one included."""
    now = int(time.time() * 1000)
    peeker = Peeker({0: [now + 3_600_000] * 3, 1: [now - 30_000, now - 120_000]})
    fetched: list[list[int]] = []
    assign = peeker.assign
    peeker.assign = lambda tps: (fetched.append(sorted(tp.partition for tp in tps)), assign(tps))  # type: ignore
    watch = RetryTierWatch("127.0.0.1:9", TopicNames(), ("email",))
    topic = "notif.email.marketing.retry.12h"
    assert 29 <= watch._overdue(peeker, topic, {0: (0, 3), 1: (0, 2)}) <= 32  # type: ignore[arg-type]
    assert 119 <= watch._overdue(peeker, topic, {0: (0, 3), 1: (1, 2)}) <= 122  # type: ignore[arg-type]
    assert 119 <= watch._overdue(peeker, topic, {0: (0, 3), 1: (1, 2)}) <= 122  # type: ignore[arg-type]
    assert fetched == [[0, 1], [1]]


class Positions:
    """The retry group's positions on a tier: read once, then the read fails (the broker, a deleted topic)."""

    def __init__(self, error: Exception):
        self.error, self.reads = error, 0

    def positions(self, group, topic):
        self.reads += 1
        if self.reads > 1:
            raise self.error
        return {0: (0, 1)}


class FailingPeeker(Peeker):
    def consume(self, num_messages=1, timeout=0):
        from confluent_kafka import KafkaError, KafkaException
        raise KafkaException(KafkaError(KafkaError._TRANSPORT))


def _exported(name: str) -> float | None:
    from prometheus_client import REGISTRY
    return REGISTRY.get_sample_value(name, {"channel": "sms", "lane": "marketing", "tier": "1h"})


def test_a_tier_that_can_no_longer_be_read_exports_no_figure_rather_than_its_last_one():
    """Given the 1 h tier measured once (a copy 10 minutes overdue), then its read failing,
    When the watch measures it again,
    Then its waiting and overdue gauges are gone rather than frozen (before: 600 s overdue stayed exported, and
    RetryTierStuck kept paging, or a stuck tier went unseen, for as long as the read failed)."""
    now = int(time.time() * 1000)
    watch = RetryTierWatch("127.0.0.1:9", TopicNames(), ("sms",))
    reader = Positions(RuntimeError("unknown topic"))
    watch._measure(reader, Peeker({0: [now - 600_000]}), "sms", "marketing", "1h")  # type: ignore[arg-type]
    assert 599 <= _exported("dispatch_retry_tier_overdue_seconds") <= 602
    watch._measure(reader, Peeker({0: [now - 600_000]}), "sms", "marketing", "1h")  # type: ignore[arg-type]
    assert (_exported("dispatch_retry_tier_overdue_seconds"), _exported("dispatch_retry_tier_waiting_messages")) \
        == (None, None)


def test_a_broker_error_while_peeking_leaves_the_watch_running():
    """Given a tier with a copy waiting, and the broker failing while the watch reads its head,
    When the watch measures it,
    Then the error ends that measurement only (before: it left the watch's thread, which stopped for good with
    every tier's last figures exported)."""
    watch = RetryTierWatch("127.0.0.1:9", TopicNames(), ("sms",))
    watch._measure(Positions(RuntimeError("unused")), FailingPeeker({0: [0]}), "sms", "marketing", "1h")  # type: ignore[arg-type]
    assert _exported("dispatch_retry_tier_overdue_seconds") is None


class Flaky(Positions):
    """Read once, fails `failures` times, then reads again."""

    def __init__(self, failures: int):
        super().__init__(RuntimeError("Unknown topic or partition"))
        self.failures = failures

    def positions(self, group, topic):
        self.reads += 1
        if 1 < self.reads <= 1 + self.failures:
            raise self.error
        return {0: (0, 1)}


def test_a_tier_that_cannot_be_read_says_for_how_long_until_it_is_read_again():
    """Given the 1 h tier measured, then its read failing for ten minutes, then read again,
    When the watch measures it each time,
    Then it exports for how long it has not been read (RetryTierUnwatched's input: before, a tier no one could read
    exported nothing, and RetryTierStuck simply stayed quiet), counted from the first failure, and 0 once read."""
    now = int(time.time() * 1000)
    watch = RetryTierWatch("127.0.0.1:9", TopicNames(), ("sms",))
    reader = Flaky(failures=2)
    measured = []
    for step in range(4):
        if step == 2:  # ten minutes after the first failure
            watch._failing_since = {t: since - 600 for t, since in watch._failing_since.items()}
        watch._measure(reader, Peeker({0: [now]}), "sms", "marketing", "1h")  # type: ignore[arg-type]
        measured.append(_exported("dispatch_retry_tier_unreadable_seconds"))
    assert measured[0] == 0.0 and measured[1] < 1 and 600 <= measured[2] < 602 and measured[3] == 0.0
    assert _exported("dispatch_retry_tier_waiting_messages") == 1


class RefusingPeeker(Peeker):
    """The broker answers the head's fetch with an error event (the monitor may describe the group, not read)."""

    def consume(self, num_messages=1, timeout=0):
        from confluent_kafka import KafkaError
        self.assigned = []
        return [SimpleNamespace(error=lambda: KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED), partition=lambda: 0)]


def test_a_tier_whose_waiting_head_cannot_be_fetched_counts_as_unreadable_not_as_on_time():
    """Given the 1 h tier with a copy waiting, whose committed offsets the monitor reads but whose messages the
    broker refuses to it (no Read on the topic),
    When the watch measures it,
    Then it exports no overdue figure and says the tier is unread (before: the refusals were skipped, the head
    never reached, and the tier was exported 0 s overdue: neither RetryTierStuck nor RetryTierUnwatched could
    fire)."""
    watch = RetryTierWatch("127.0.0.1:9", TopicNames(), ("sms",))
    watch._measure(Positions(RuntimeError("unused")), RefusingPeeker({0: [0]}), "sms", "marketing", "1h")  # type: ignore[arg-type]
    assert _exported("dispatch_retry_tier_overdue_seconds") is None
    assert _exported("dispatch_retry_tier_unreadable_seconds") is not None


class SilentPeeker(Peeker):
    """The broker gives nothing in time (overloaded, a partition's leader moving)."""

    def consume(self, num_messages=1, timeout=0):
        return []


class MarkerOnlyPeeker(Peeker):
    """Past the committed position there is only a transaction's marker: the fetch reaches the end, no message."""

    def consume(self, num_messages=1, timeout=0):
        from confluent_kafka import KafkaError
        ended, self.assigned = self.assigned, []
        return [SimpleNamespace(error=lambda: KafkaError(KafkaError._PARTITION_EOF), partition=lambda p=p: p)
                for p, _ in ended]


def test_a_tier_whose_waiting_head_is_not_given_in_time_counts_as_unreadable_not_as_on_time():
    """Given the 1 h tier with a copy waiting, whose head the broker does not give within the watch's time,
    When the watch measures it,
    Then it exports no overdue figure and says the tier is unread (before: 0 s overdue, so a stuck tier on a slow
    broker looked on time and neither RetryTierStuck nor RetryTierUnwatched fired); a position followed only by a
    transaction's marker is read to its end, and is on time."""
    watch = RetryTierWatch("127.0.0.1:9", TopicNames(), ("sms",))
    watch.head_timeout_s = 0.3
    watch._measure(Positions(RuntimeError("unused")), SilentPeeker({0: [0]}), "sms", "marketing", "1h")  # type: ignore[arg-type]
    assert _exported("dispatch_retry_tier_overdue_seconds") is None
    assert _exported("dispatch_retry_tier_unreadable_seconds") is not None
    watch._measure(Positions(RuntimeError("unused")), MarkerOnlyPeeker({0: [0]}), "sms", "marketing", "1h")  # type: ignore[arg-type]
    assert _exported("dispatch_retry_tier_overdue_seconds") == 0
    assert _exported("dispatch_retry_tier_unreadable_seconds") == 0


@pytest.mark.parametrize("measure, metric, group, topic, channels, alert", [
    ("_measure_endpoint_health", "dispatch_endpoint_health_behind_seconds", "endpoint-health",
     "notif.webhook.attempts", ("webhook",), "EndpointHealthBehind past 10 minutes"),
    # On every channel: before, nothing watched the recorder, and a stopped one left every status behind unsaid
    ("_measure_outcome_recorder", "dispatch_outcome_recorder_behind_seconds", "status-recorder", "notif.outcomes",
     ("email",), "OutcomeRecorderBehind past 5 minutes"),
])
def test_a_followers_progress_is_exported_and_none_when_it_cannot_be_read(measure, metric, group, topic, channels,
                                                                          alert):
    """Given the endpoint-health app's group (or the outcome recorder's) whose oldest record not applied yet is 700 s
    old,
    When the lag monitor's watch (of the webhook channel; of the email one for the recorder) measures it, then cannot
    read it any more,
    Then it exports 700 s (the alert fires past its threshold), then NaN: no figure rather than the last, and how
    long it has not been read (FollowerUnwatched: NaN silences the behind alert), 0 once read again."""
    import math

    from prometheus_client import REGISTRY

    from streams.lag.yield_policy import LagReading

    names = TopicNames(f"{group}-watch-test.")
    asked = []

    class Reader:
        failing = False

        def read(self, group, topic, source="monitor"):
            asked.append((group, topic))
            if self.failing:
                raise RuntimeError("coordinator not available")
            return LagReading(40, 700.0, int(time.time() * 1000), source)

    # A process that does not measure it exports nothing (it exported 0, and the alert's `min` never passed its
    # threshold): its gauge is labelled by the group, and only the lag monitor sets it
    assert REGISTRY.get_sample_value(metric) is None, alert
    watch, reader = RetryTierWatch("unused:9092", names, channels), Reader()
    getattr(watch, measure)(reader)
    labels = {"group": f"{group}-watch-test.{group}"}
    assert REGISTRY.get_sample_value(metric, labels) == 700.0
    assert asked == [(f"{group}-watch-test.{group}", f"{group}-watch-test.{topic}")]
    assert REGISTRY.get_sample_value("dispatch_follower_unreadable_seconds", labels) == 0
    reader.failing = True
    getattr(watch, measure)(reader)
    assert math.isnan(REGISTRY.get_sample_value(metric, labels))
    watch._failing_since[labels["group"]] -= 400  # the reads started failing 400 s ago
    getattr(watch, measure)(reader)
    assert REGISTRY.get_sample_value("dispatch_follower_unreadable_seconds", labels) >= 400
    reader.failing = False
    getattr(watch, measure)(reader)
    assert REGISTRY.get_sample_value("dispatch_follower_unreadable_seconds", labels) == 0
