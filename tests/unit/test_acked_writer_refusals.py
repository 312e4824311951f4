"""The broker refuses a whole batch of records for its size: the acknowledged writer tries a record
refused in a batch again alone, and only a record refused alone is given up on (`on_refused`)."""

import logging
from collections import Counter

from confluent_kafka import KafkaError, KafkaException

from streams.kafka_client import AckedWriter


class ScriptedProducer:
    """Answers each produce of a record with the next error its script names (None: acknowledged)."""

    def __init__(self, script: dict[bytes, list[int | None]]):
        self.script, self.waiting, self.produced = script, [], []

    def produce(self, topic, value=None, key=None, headers=None, on_delivery=None):
        self.produced.append(value)
        self.waiting.append((value, on_delivery))

    def poll(self, timeout=0):
        waiting, self.waiting = self.waiting, []
        for value, on_delivery in waiting:
            code = self.script[value].pop(0)
            on_delivery(None if code is None else KafkaError(code), Written())
        return len(waiting)

    def flush(self, timeout=0):
        self.poll()
        return 0

    def __len__(self):
        return len(self.waiting)


class Written:
    def partition(self): return 0
    def offset(self): return 7


def run(writer: AckedWriter, producer: ScriptedProducer, rounds: int = 10) -> None:
    for _ in range(rounds):
        for outage in writer.outages.values():
            outage.next_try_at = 0.0  # no backoff waits in a unit test
        writer.poll(0)


def test_a_record_refused_only_with_its_batch_is_acknowledged_alone_and_one_too_large_is_given_up():
    """Given a small record refused with the batch it went in, and a big one refused in the batch and alone,
    When the writer serves its delivery reports,
    Then the small one is acknowledged (tried alone) and only the big one reaches `on_refused`."""
    too_large = KafkaError.MSG_SIZE_TOO_LARGE
    producer = ScriptedProducer({b"small": [too_large, None], b"big": [too_large, too_large]})
    writer = AckedWriter(producer, "test")  # type: ignore[arg-type]
    acked, refused = [], []
    for value in (b"small", b"big"):
        writer.write("t", value, on_ack=lambda v=value: acked.append(v), on_refused=lambda err, v=value: refused.append(v))
    run(writer, producer)
    assert (acked, refused, writer.pending, writer.pending_bytes) == ([b"small"], [b"big"], 0, 0)


def test_a_record_sent_again_with_others_after_a_timeout_is_tried_alone_again_before_it_is_given_up():
    """Given a record refused in a batch, whose try alone timed out (the broker in trouble), and which is then
    produced again with others and refused with their batch,
    When the writer serves its delivery reports,
    Then it is tried alone once more and acknowledged, never given up on (before: `on_refused`, a dead letter
    of a record of ordinary size)."""
    too_large, timed_out = KafkaError.MSG_SIZE_TOO_LARGE, KafkaError._MSG_TIMED_OUT
    producer = ScriptedProducer({b"small": [too_large, timed_out, too_large, None]})
    writer = AckedWriter(producer, "test")  # type: ignore[arg-type]
    acked, refused = [], []
    writer.write("t", b"small", on_ack=lambda: acked.append(1), on_refused=lambda err: refused.append(err))
    run(writer, producer)
    assert (acked, refused, len(producer.produced), writer.pending) == ([1], [], 4, 0)


class SlowBroker(ScriptedProducer):
    """A broker whose acknowledgements come late: while `late` names flushes, each flush in turn acknowledges
    what is queued (True) or nothing (False, returning what is still queued); polls acknowledge nothing then."""

    def __init__(self, script):
        super().__init__(script)
        self.late: list[bool] = []

    def poll(self, timeout=0):
        return 0 if self.late else super().poll(timeout)

    def flush(self, timeout=0):
        if self.late and not self.late.pop(0):
            return len(self.waiting)
        return super().flush(timeout)


def test_a_record_to_try_alone_waits_for_an_empty_queue_and_a_try_not_confirmed_alone_is_not_its_refusal():
    """Given a small record refused with its batch, then a broker too slow to empty the producer's queue
    within a flush while other records keep being written, and then too slow to acknowledge its try alone,
    When the writer serves its delivery reports,
    Then the small record is not produced beside the queued records, and a refusal of a try that was not
    confirmed alone is not taken as its own: it is acknowledged in the end, never given up on."""
    too_large = KafkaError.MSG_SIZE_TOO_LARGE
    producer = SlowBroker({b"small": [too_large, too_large, None], b"other": [None] * 10})
    writer = AckedWriter(producer, "test")  # type: ignore[arg-type]
    acked, refused = [], []
    writer.write("t", b"small", on_ack=lambda: acked.append(1), on_refused=lambda err: refused.append(err))
    producer.poll()  # its batch is refused: it waits to be tried alone
    writer.write("t", b"other")
    producer.late = [False]  # the queue holding `other` does not empty in time: `small` waits
    writer.poll(0)
    assert producer.produced == [b"small", b"other"]
    producer.late = [True, False]  # emptied now, but its own try is not acknowledged within the flush after it
    writer.poll(0)
    assert producer.produced == [b"small", b"other", b"small"]
    writer.write("t", b"other")  # produced beside it: their batch is refused
    run(writer, producer)
    assert (acked, refused, writer.pending) == ([1], [], 0)


class DenyingProducer:
    """librdkafka for a topic the cluster denies (an ACL) or does not have: the first record, queued before the
    metadata came, fails in its delivery report; from then on produce() to it raises at once, until the topic
    is there (`allowed`)."""

    def __init__(self):
        self.waiting, self.marked_bad, self.allowed = [], False, False

    def produce(self, topic, value=None, key=None, headers=None, on_delivery=None):
        if self.marked_bad and not self.allowed:
            raise KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED))
        self.waiting.append(on_delivery)

    def poll(self, timeout=0):
        waiting, self.waiting = self.waiting, []
        for on_delivery in waiting:
            if self.allowed:
                on_delivery(None, Written())
            else:
                self.marked_bad = True
                on_delivery(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED), None)
        return len(waiting)

    def flush(self, timeout=0):
        self.poll()
        return 0


def test_records_for_a_topic_the_cluster_denies_are_held_and_written_once_it_allows_them():
    """Given a topic the cluster denies (its first record failed in its delivery report, later produces raise),
    When records for it are written and produced again after the backoff, then the topic is allowed,
    Then nothing raises (before: the produce's refusal left the worker's step, and the worker crashed again on
    every restart at its first retry copy or dead letter), both records stay pending, unacknowledged, and both
    are acknowledged once it is allowed."""
    producer = DenyingProducer()
    writer = AckedWriter(producer, "test")  # type: ignore[arg-type]
    acked = []
    writer.write("notif.email.marketing.retry.5m", b"first", on_ack=lambda: acked.append(b"first"))
    run(writer, producer, rounds=1)
    writer.write("notif.email.marketing.retry.5m", b"second", on_ack=lambda: acked.append(b"second"))
    run(writer, producer, rounds=3)
    assert (writer.pending, acked) == (2, [])
    producer.allowed = True
    run(writer, producer, rounds=3)
    assert (writer.pending, writer.pending_bytes, sorted(acked)) == (0, 0, [b"first", b"second"])


class OneTopicDenied:
    """Records to `denied` fail in their delivery report (an ACL, a partition without its replicas); every other
    topic is acknowledged."""

    def __init__(self):
        self.waiting, self.produced = [], Counter()

    def produce(self, topic, value=None, key=None, headers=None, on_delivery=None):
        self.produced[topic] += 1
        self.waiting.append((topic, on_delivery))

    def poll(self, timeout=0):
        waiting, self.waiting = self.waiting, []
        for topic, on_delivery in waiting:
            on_delivery(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED) if topic == "denied" else None, Written())
        return len(waiting)

    def flush(self, timeout=0):
        self.poll()
        return 0


def test_a_failing_topic_keeps_its_backoff_while_another_topic_is_acknowledged(caplog):
    """Given one topic whose records fail and another acknowledged at once, written to on every poll (a worker's
    outcomes while a retry tier is denied),
    When the writer is polled 200 times in a row,
    Then the failing record is produced again no sooner than its backoff allows (once here: the loop takes less
    than the first backoff) and one log line opens the episode (before: every acknowledgement of the other topic
    ended the episode and reset the backoff, so the record went again on every poll and each time logged the
    outage again, and its end: hundreds of produces and lines a second)."""
    producer = OneTopicDenied()
    writer = AckedWriter(producer, "test")  # type: ignore[arg-type]
    writer.write("denied", b"copy")
    with caplog.at_level(logging.WARNING, logger="streams.backoff"):
        for _ in range(200):
            writer.write("outcomes", b"outcome")
            writer.poll(0)
    assert producer.produced["denied"] == 1 and producer.produced["outcomes"] == 200
    assert [r.getMessage().split(" unavailable")[0] for r in caplog.records] == ["Kafka (test writes to denied)"]
    assert writer.pending == 1


def test_the_writer_exports_how_long_the_broker_has_acknowledged_nothing_of_a_failing_topic(monkeypatch):
    """Given a writer whose records to a topic the cluster denies fail,
    When 3 minutes pass with the failing record produced again, and then the topic is allowed,
    Then `dispatch_produce_failing_seconds` says 180 s (what RecordsUnacknowledged reads), and 0 once that
    topic's record is acknowledged."""
    from prometheus_client import REGISTRY

    from streams import kafka_client

    now = [1000.0]
    monkeypatch.setattr(kafka_client.time, "monotonic", lambda: now[0])
    producer = DenyingProducer()
    writer = AckedWriter(producer, "failing-test")  # type: ignore[arg-type]

    def exported() -> float | None:
        return REGISTRY.get_sample_value("dispatch_produce_failing_seconds", {"writer": "failing-test"})

    writer.write("notif.email.marketing.retry.5m", b"copy")
    run(writer, producer, rounds=1)
    assert exported() == 0.0  # failed at 1000 s, measured at once
    now[0] += 180
    run(writer, producer, rounds=2)
    assert exported() == 180.0
    producer.allowed = True
    run(writer, producer, rounds=2)
    assert (writer.pending, exported()) == (0, 0.0)


class OnePartitionDown(OneTopicDenied):
    """Records keyed b"stuck" go to a partition below its min.insync.replicas and fail; the topic's others are
    acknowledged."""

    def produce(self, topic, value=None, key=None, headers=None, on_delivery=None):
        self.produced[topic] += 1
        self.waiting.append((key, on_delivery))

    def poll(self, timeout=0):
        waiting, self.waiting = self.waiting, []
        for key, on_delivery in waiting:
            on_delivery(KafkaError(KafkaError.NOT_ENOUGH_REPLICAS) if key == b"stuck" else None, Written())
        return len(waiting)


def test_one_partition_that_cannot_be_written_shows_while_the_topics_others_acknowledge(monkeypatch):
    """Given an outcome whose partition the broker cannot write, and the topic's other partitions acknowledging
    a record every poll,
    When 5 minutes pass,
    Then `dispatch_produce_failing_seconds` says 270 s, since its first failure (before the fix it measured the topic's episode, which
    every acknowledgement of another partition ended: 0, and RecordsUnacknowledged stayed silent while the
    record, and the offsets behind it, waited)."""
    from prometheus_client import REGISTRY

    from streams import kafka_client

    now = [1000.0]
    monkeypatch.setattr(kafka_client.time, "monotonic", lambda: now[0])
    producer = OnePartitionDown()
    writer = AckedWriter(producer, "partition-test")  # type: ignore[arg-type]
    writer.write("notif.outcomes", b"stuck outcome", key=b"stuck")
    for _ in range(10):
        writer.write("notif.outcomes", b"another", key=b"fine")
        now[0] += 30
        run(writer, producer, rounds=1)
    assert writer.pending == 1
    # its first failure came with the first poll, 30 s in
    assert REGISTRY.get_sample_value("dispatch_produce_failing_seconds", {"writer": "partition-test"}) == 270.0
