"""The retrier's memory bound counts what it released and the lane has not acknowledged yet: those copies
are still in its process (payload and all), so a lane topic that does not acknowledge (an ACL, a partition
without its replicas) cannot make it read on without bound. No broker: the consumer records pauses and the
producer never acknowledges."""

import orjson
import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition
from prometheus_client import REGISTRY

from streams.kafka_client import ALONE_TRIES, AckedWriter
from streams.retry.retrier import Held, Retrier, RetrierConfig
from tests.harness import AcknowledgingProducer, PauseRecordingConsumer


class SilentProducer:
    """The broker takes records and never acknowledges them."""

    def produce(self, topic, value=None, key=None, headers=None, on_delivery=None):
        pass

    def poll(self, timeout=0):
        return 0

    def flush(self, timeout=0):
        return 1


def _retrier(now_ms: float, channel: str = "email", lane: str = "marketing") -> Retrier:
    r = Retrier(RetrierConfig(channel, lane, "127.0.0.1:1", max_held=1_000, max_held_bytes=100_000),
                clock=lambda: now_ms / 1000)
    r.consumer.close()
    r.consumer = PauseRecordingConsumer()  # type: ignore[assignment]
    r.writer = AckedWriter(SilentProducer(), "test")  # type: ignore[arg-type]
    return r


def test_released_copies_the_lane_has_not_acknowledged_count_against_the_byte_bound():
    """Given a retrier bounded to 100 kB, holding one message due in an hour on the 1h tier's partition,
    When it releases 15 due copies of 10 kB each that the lane never acknowledges,
    Then it pauses the partition holding the late message only (150 kB unacknowledged is past the bound; before,
    only the held heap's bytes counted, and it read on)."""
    now = 1_000_000_000_000
    r = _retrier(now)
    hour_tier, ten_s_tier = r.cfg.topics[4], r.cfg.topics[0]
    r.assigned = {(hour_tier, 0), (ten_s_tier, 0)}
    r._keep(Held(now + 3_600_000, 1, hour_tier, 0, None, b"x" * 100, {}))
    for offset in range(15):
        r._republish(Held(now, offset, ten_s_tier, 0, None, b"y" * 10_000, {}), now)
    assert r.writer.pending == 15
    r._bound_memory()
    assert r.consumer.paused == {(hour_tier, 0)}


class _Message:
    def __init__(self, topic, partition, offset):
        self._where = (topic, partition, offset)

    def error(self): return None
    def topic(self): return self._where[0]
    def partition(self): return self._where[1]
    def offset(self): return self._where[2]
    def headers(self): return []
    def key(self): return None
    def value(self): return b"{}"
    def timestamp(self): return (0, 0)  # TIMESTAMP_NOT_AVAILABLE


def test_a_message_of_a_partition_revoked_after_the_poll_returned_it_is_not_held():
    """librdkafka serves a revoke in the consume that follows the poll, after the poll returned a message of the
    revoked partition. Held, that message would bring the partition's offsets back into this retrier (stored
    below the new owner's commit should the partition come back); its new owner reads it again."""
    now = 1_000_000_000_000
    r = _retrier(now)
    tier = r.cfg.topics[0]
    r.assigned = {(tier, 0)}
    r._hold(_Message(tier, 1, 40))
    r._hold(_Message(tier, 0, 7))
    assert [(h.partition, h.offset) for h in r.heap] == [(0, 7)]
    assert set(r.tracker.committable()) == {(tier, 0)}


class RevokeAfterPoll(PauseRecordingConsumer):
    """Hands out one message per poll and knows its position; once asked to, the consume after a poll serves a
    revoke of the retrier's partitions (as librdkafka may)."""

    def __init__(self, retrier_of):
        super().__init__()
        self.retrier_of, self.revoke_next = retrier_of, False
        self.queue: list = []
        self.stored: dict[tuple[str, int], int] = {}
        self.positions: dict[tuple[str, int], int] = {}

    def poll(self, timeout=0):
        if not self.queue:
            return None
        msg = self.queue.pop(0)
        self.positions[(msg.topic(), msg.partition())] = msg.offset() + 1
        return msg

    def consume(self, num_messages=1, timeout=0):
        if self.revoke_next:
            self.revoke_next = False
            retrier = self.retrier_of()
            retrier._on_revoke(self, [TopicPartition(t, p) for t, p in retrier.assigned])
        return []

    def store_offsets(self, offsets):
        self.stored.update({(tp.topic, tp.partition): tp.offset for tp in offsets})

    def position(self, partitions):
        return [TopicPartition(tp.topic, tp.partition, self.positions.get((tp.topic, tp.partition), -1001))
                for tp in partitions]

    def commit(self, asynchronous=True):
        pass


def test_a_revoke_served_after_the_poll_returned_a_retry_copy_stores_no_offset_past_it():
    """Given a retrier that has re-published the copy at offset 5 of the 10 s tier (acknowledged: nothing of the
    partition unfinished),
    When its next poll returns the copy at offset 6 and the consume after that poll serves the partition's revoke,
    Then the offset stored for the partition is 6, so its new owner reads that copy (this retrier drops it);
    before, the consumer's position (7) was stored and the copy was never re-published by anyone."""
    now = 1_000_000_000_000
    holder: list = []
    r = Retrier(RetrierConfig("email", "marketing", "127.0.0.1:1"), clock=lambda: now / 1000)
    r.consumer.close()
    consumer = RevokeAfterPoll(lambda: holder[0])
    r.consumer = consumer  # type: ignore[assignment]
    r.writer = AckedWriter(AcknowledgingProducer(), "test")  # type: ignore[arg-type]
    holder.append(r)
    tier = r.cfg.topics[0]
    r.assigned = {(tier, 0)}
    consumer.queue.append(_Message(tier, 0, 5))
    r.step()
    r.step()
    assert consumer.stored[(tier, 0)] == 6 and not r.heap

    consumer.queue.append(_Message(tier, 0, 6))
    consumer.revoke_next = True
    r.step()
    assert consumer.stored[(tier, 0)] == 6 and consumer.positions[(tier, 0)] == 7
    assert not r.heap and not r.assigned


def test_released_copies_the_lane_has_not_acknowledged_are_shown_held_and_overdue():
    """Given a retrier that released 3 due copies of the 10s tier to a lane that does not acknowledge them (an
    ACL, a partition without its replicas),
    When its metrics are read a minute later,
    Then the tier shows 3 held, a minute overdue (before: 0 held and 0 s overdue, the dashboard saying the tiers
    were healthy while nothing was released); once the lane acknowledges them, 0."""
    now = [1_000_000_000_000]
    r = Retrier(RetrierConfig("email", "marketing", "127.0.0.1:1"), clock=lambda: now[0] / 1000)
    r.consumer.close()
    r.consumer = PauseRecordingConsumer()  # type: ignore[assignment]
    producer = AcknowledgingProducer(acknowledging=False)
    r.writer = AckedWriter(producer, "test")  # type: ignore[arg-type]
    tier = r.cfg.topics[0]
    r.assigned = {(tier, 0)}
    for offset in range(3):
        r._republish(Held(now[0], offset, tier, 0, None, b"y", {}), now[0])
    now[0] += 60_000
    r._metrics()
    labels = {"channel": "email", "lane": "marketing", "tier": "10s"}
    assert REGISTRY.get_sample_value("dispatch_retry_held_messages", labels) == 3
    assert REGISTRY.get_sample_value("dispatch_retry_overdue_seconds", labels) == 60
    producer.acknowledging = True
    r.writer.poll(0)
    r._metrics()
    assert REGISTRY.get_sample_value("dispatch_retry_held_messages", labels) == 0
    assert REGISTRY.get_sample_value("dispatch_retry_overdue_seconds", labels) == 0


def test_a_copy_without_a_due_time_is_overdue_from_its_reading_not_since_1970():
    """Given a retry copy with no usable due time (due now: released at once) that the lane has not acknowledged,
    When the retrier reports its tiers a minute later,
    Then the tier shows it a minute overdue (before: about 1.8e9 s, counted from a due time of 0)."""
    now = [1_800_000_000_000]
    r = Retrier(RetrierConfig("email", "marketing", "127.0.0.1:1"), clock=lambda: now[0] / 1000)
    r.consumer.close()
    r.consumer = PauseRecordingConsumer()  # type: ignore[assignment]
    r.writer = AckedWriter(AcknowledgingProducer(acknowledging=False), "test")  # type: ignore[arg-type]
    tier = r.cfg.topics[0]
    r.assigned = {(tier, 0)}
    r._hold(_Message(tier, 0, 5))  # no headers: due now
    r._release_due()
    now[0] += 60_000
    r._metrics()
    labels = {"channel": "email", "lane": "marketing", "tier": "10s"}
    assert REGISTRY.get_sample_value("dispatch_retry_held_messages", labels) == 1
    assert REGISTRY.get_sample_value("dispatch_retry_overdue_seconds", labels) == 60


class RecordingProducer(AcknowledgingProducer):
    """Acknowledges every record at the next poll, and keeps (topic, value, headers) of each."""

    def __init__(self):
        super().__init__()
        self.records: list = []

    def produce(self, topic, value=None, key=None, headers=None, on_delivery=None):
        self.records.append((topic, value, dict(headers or [])))
        super().produce(topic, value, key, headers, on_delivery)


class _UnreadableHeaders(_Message):
    def headers(self):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")


def test_a_copy_whose_headers_cannot_be_read_is_dead_lettered_not_sent_on_without_them():
    """Given a retry record whose header names are not UTF-8 (no worker writes one),
    When the retrier reads it,
    Then it is dead-lettered `malformed` with its payload and where it was, and its offset moves on once that is
    acknowledged (before: it was re-published to the lane without headers, where the worker took it for a stale
    first attempt and ended it with no dead letter, its send's chain lost unseen)."""
    r = _retrier(1_800_000_000_000)
    producer = RecordingProducer()
    r.writer = AckedWriter(producer, "test")  # type: ignore[arg-type]
    tier = r.cfg.topics[0]
    r.assigned = {(tier, 0)}
    r._hold(_UnreadableHeaders(tier, 0, 9))
    r._release_due()
    r.writer.poll(0)
    [(topic, value, headers)] = producer.records
    assert topic == r.cfg.names.dlq and value == b"{}" and r.heap == []
    assert (headers["reason"], headers["origin_topic"], headers["origin_offset"]) == (b"malformed", tier.encode(), b"9")
    assert r.tracker.committable() == {(tier, 0): 10}


def test_a_long_tiers_backlog_read_at_full_speed_never_pauses_the_short_tiers():
    """Given a retrier bounded to 1,000 messages, reading after a restart four partitions of the 12h tier, each
    handing it a batch of 500 copies due in 12 hours within one second,
    When it bounds its memory after each batch,
    Then each 12h partition is paused once it holds such copies past the bound, and the 10 s tier's partition is
    never paused (before: the partitions holding late copies were looked up at most once a second, the last two
    batches were read, and 2,000 held paused every partition, the 10 s tier for up to 12 hours); it is paused
    once copies due soon and late copies up to the bound hold twice the bound."""
    now = 1_000_000_000_000
    r = _retrier(now)
    ten_s, twelve_h = r.cfg.topics[0], r.cfg.topics[-1]
    r.assigned = {(ten_s, 0), *((twelve_h, p) for p in range(4))}
    for p in range(4):
        for offset in range(500):
            r._keep(Held(now + 12 * 3_600_000, offset, twelve_h, p, None, b"x", {}))
        r._bound_memory()
        assert (ten_s, 0) not in r.consumer.paused
    assert r.consumer.paused == {(twelve_h, p) for p in range(4)}
    for offset in range(999):
        r._keep(Held(now + 10_000, offset, ten_s, 0, None, b"y", {}))
    r._bound_memory()
    assert (ten_s, 0) not in r.consumer.paused
    r._keep(Held(now + 10_000, 999, ten_s, 0, None, b"y", {}))
    r._bound_memory()
    assert (ten_s, 0) in r.consumer.paused


class SizeLimitedProducer(RecordingProducer):
    """Refuses, before it leaves the process, a record over 1 MiB (as librdkafka does past message.max.bytes)."""

    def produce(self, topic, value=None, key=None, headers=None, on_delivery=None):
        size = len(value or b"") + len(key or b"") + sum(len(k) + len(v or b"") for k, v in dict(headers or []).items())
        if size > 1024 * 1024:
            raise KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
        super().produce(topic, value, key, headers, on_delivery)


def test_a_copy_with_unreadable_headers_and_a_huge_send_id_is_dead_lettered_without_it_and_moves_on():
    """Given a retry record with header names that are not UTF-8 and a payload naming a 600 kB "send id",
    When the retrier reads it, with a producer refusing records over 1 MiB,
    Then it is dead-lettered with its payload, unkeyed and with no send id, and its offset moves on (before: the
    id keyed and headed the letter, 1.8 MB, then 1.2 MB without the payload: refused, the retrier raised, and
    restarted on the same offset for ever, every tier of the lane stopped)."""
    r = _retrier(1_800_000_000_000)
    producer = SizeLimitedProducer()
    r.writer = AckedWriter(producer, "test")  # type: ignore[arg-type]
    tier = r.cfg.topics[0]
    r.assigned = {(tier, 0)}
    payload = orjson.dumps({"send_id": "x" * 600_000})

    class Huge(_UnreadableHeaders):
        def value(self):
            return payload

    r._hold(Huge(tier, 0, 3))
    r.writer.poll(0)
    [(topic, value, headers)] = producer.records
    assert (topic, value, headers["send_id"], headers["reason"]) == (r.cfg.names.dlq, payload, b"", b"malformed")
    assert r.tracker.committable() == {(tier, 0): 4}


def _hold_unreadable_copy(r: Retrier, send) -> tuple[RecordingProducer, str]:
    """`r` records what it writes, and reads a retry copy of `send` whose header names are not UTF-8 (offset 11 of
    its first tier's partition 0, which it returns)."""
    from streams.send import encode

    producer = RecordingProducer()
    r.writer = AckedWriter(producer, "test")  # type: ignore[arg-type]
    tier = r.cfg.topics[0]
    r.assigned = {(tier, 0)}

    class OfASend(_UnreadableHeaders):
        def value(self):
            return encode(send)

    r._hold(OfASend(tier, 0, 11))
    return producer, tier


def test_a_send_dead_lettered_for_unreadable_headers_gets_its_outcome():
    """Given a retry record of a real send whose header names are not UTF-8,
    When the retrier dead-letters it,
    Then the letter names the send and its tenant, the send's outcome says dead-lettered `malformed`, where the letter
    is, and the offset moves on once that is acknowledged (before: no outcome: its status stayed `retrying`, and a
    replay refused it as in progress; no tenant on the letter)."""
    from streams.send import build_send, validate_request
    from tests.harness import email_request

    send = build_send(validate_request(email_request()), "acme")
    r = _retrier(1_800_000_000_000)
    producer, tier = _hold_unreadable_copy(r, send)
    r.writer.poll(0)
    r.writer.poll(0)
    [(dlq, _, headers), (outcomes, event, _)] = producer.records
    assert (dlq, outcomes, headers["send_id"]) == (r.cfg.names.dlq, r.cfg.names.outcomes, send.send_id.encode())
    assert headers["tenant"] == b"acme"  # as every letter names it (`streams dlq list` showed `tenant=-`)
    event = orjson.loads(event)
    assert (event["send_id"], event["status"], event["reason"]) == (send.send_id, "dead_lettered", "malformed")
    assert event["dlq"] == {"partition": 0, "offset": 0}
    assert r.tracker.committable() == {(tier, 0): 12}


def test_a_partition_assigned_to_a_retrier_at_its_bound_is_paused_even_on_its_first_assignment():
    """Given a retrier holding as many bytes as it may, and a consumer that, like librdkafka, skips a pause of a
    partition not yet assigned (inside on_assign, confluent-kafka assigns only once the callback returns),
    When a partition is assigned to it,
    Then that partition is paused (before: the pause was skipped, and the retrier read on past its memory bound)."""
    now = 1_000_000_000_000
    r = _retrier(now)
    r.consumer = consumer = PauseRecordingConsumer(assigned_only=True)  # type: ignore[assignment]
    hour_tier, ten_s_tier = r.cfg.topics[4], r.cfg.topics[0]
    r.assigned = {(hour_tier, 0)}
    r._keep(Held(now + 1_000, 1, hour_tier, 0, None, b"x" * 200_000, {}))  # twice the bound, due in a second
    r._on_assign(consumer, [TopicPartition(ten_s_tier, 0)])
    assert consumer.paused == {(ten_s_tier, 0)}


def test_a_webhook_delivery_dead_lettered_by_the_retrier_is_said_on_the_attempts_topic():
    """Given a webhook retrier and a retry record of a webhook delivery whose header names are not UTF-8,
    When the retrier dead-letters it,
    Then besides its outcome (`dropped`, `malformed`) a `not_attempted` event naming the reason goes to the attempts
    topic, keyed by its endpoint, so its tenant's members get the "Webhook event dropped" email as for a delivery the
    worker drops; the retry record is finished only once both are acknowledged (before: the outcome alone, and no
    email)."""
    from streams.send import build_send, validate_request
    from tests.harness import webhook_event

    request = webhook_event()
    request["payload"] = {**request["payload"], "event_id": "ev_1", "endpoint_id": "ep_1"}
    send = build_send(validate_request(request), "acme")
    r = _retrier(1_800_000_000_000, "webhook", "transactional")
    producer, tier = _hold_unreadable_copy(r, send)
    r.writer.poll(0)  # the dead letter acknowledged: the outcome and the attempt event are written
    assert r.tracker.committable() == {(tier, 0): 11}  # not past it yet
    r.writer.poll(0)
    [_, (outcomes, event, _), (attempts, attempt, _)] = producer.records
    assert (outcomes, attempts) == (r.cfg.names.outcomes, r.cfg.names.webhook_attempts)
    assert (orjson.loads(event)["status"], orjson.loads(event)["reason"]) == ("dropped", "malformed")
    attempt = orjson.loads(attempt)
    assert (attempt["kind"], attempt["delivery_id"], attempt["endpoint_id"]) == ("attempt", send.send_id, "ep_1")
    assert (attempt["outcome"], attempt["dropped"]) == ("not_attempted", "malformed")
    assert r.tracker.committable() == {(tier, 0): 12}


class LaneRefusingProducer(RecordingProducer):
    """Refuses every record to `lane` with `code`, as a broker answers a record it will never take."""

    def __init__(self, lane: str, code: int):
        super().__init__()
        self.lane, self.code = lane, code

    def produce(self, topic, value=None, key=None, headers=None, on_delivery=None):
        if topic != self.lane:
            return super().produce(topic, value, key, headers, on_delivery)
        self.records.append((topic, value, dict(headers or [])))
        self.reports.append(lambda err, msg, report=on_delivery: report(KafkaError(self.code), msg))


@pytest.mark.parametrize("code, reason, detail", [
    (KafkaError.MSG_SIZE_TOO_LARGE, b"too_large", b"lane_copy_too_large"),
    (KafkaError.INVALID_RECORD, b"malformed", b"lane_refused:INVALID_RECORD"),
])
def test_a_copy_the_lane_refuses_is_dead_lettered_saying_why(code, reason, detail):
    """Given a due retry copy that the lane refuses, for its size or as an invalid record,
    When the retrier releases it,
    Then it is dead-lettered without its payload, saying why the lane refused it (before: every refusal was called
    `too_large` for its size, an invalid record's real error only in a log line before it)."""
    r = _retrier(1_800_000_000_000)
    producer = LaneRefusingProducer(r.cfg.names.lane(r.cfg.channel, r.cfg.lane), code)
    r.writer = AckedWriter(producer, "test")  # type: ignore[arg-type]
    tier = r.cfg.topics[0]
    r.assigned = {(tier, 0)}
    r._republish(Held(1_800_000_000_000, 5, tier, 0, b"acme", b"{}", {"send_id": b"s-1", "attempt": b"2"}),
                 1_800_000_000_000)
    for _ in range(2 + ALONE_TRIES * 2):  # a refusal is taken as the record's own once it is refused alone
        r.writer.poll(0)
    [letter] = [headers for topic, _, headers in producer.records if topic == r.cfg.names.dlq]
    assert (letter["reason"], letter["reason_detail"], letter["send_id"]) == (reason, detail, b"s-1")
