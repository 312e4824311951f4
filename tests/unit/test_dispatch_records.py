"""What a lane worker writes to Kafka (streams/dispatch/records.py), with an in-memory producer: the headers
of retry copies and dead letters."""

from __future__ import annotations

import time

import orjson
from confluent_kafka import KafkaError
from prometheus_client import REGISTRY

from streams.dispatch.records import RecordWriter
from streams.dispatch.tenant_queues import Pending
from streams.providers.outcome import ProviderResult
from streams.retry.policy import RetryAt
from streams.send import build_send, encode, validate_request
from tests.harness import email_request, webhook_event
from tests.unit.test_worker_loop import NAMES, FakeMessage, FakeProducer

LANE = NAMES.lane("webhook", "transactional")


def _writer() -> tuple[RecordWriter, FakeProducer]:
    producer = FakeProducer()
    return RecordWriter(producer, NAMES, "webhook", "transactional", "webhook", LANE, "g"), producer


def _delivery(attempt: int = 1) -> Pending:
    request = webhook_event()
    request["payload"] = {**request["payload"], "event_id": "ev_1", "endpoint_id": "ep_1"}
    send = build_send(validate_request(request), "acme")
    return Pending(LANE, 0, 5, encode(send), {}, send, attempt)


def _flush(producer: FakeProducer) -> None:
    while producer.poll():
        pass


def test_a_webhook_receivers_answer_never_reaches_retry_or_dead_letter_headers():
    """Given a webhook receiver that answered 500 echoing the event back (a person's name and street),
    When its delivery is copied to a retry tier, and when it is dead-lettered,
    Then no header of the retry copy or the dead letter carries the answer (they say status and error class), nor
    does the attempt event (the attempts topic is kept 30 days, and nothing read the excerpt it carried)."""
    echo = ProviderResult("unavailable", 500, error_name="http_500",
                          error_body='echo {"name": "Jane Roe", "street": "1 Elm Row"}')
    writer, producer = _writer()
    now_ms = int(time.time() * 1000)
    writer.retry(_delivery(), RetryAt("10s", now_ms + 10_000, "http_500"), echo, now_ms, lambda: None,
                 ["webhook"])
    writer.dead_letter(_delivery(9), "retries_exhausted", echo, now_ms, lambda: None, ["webhook"])
    writer.webhook_attempt(_delivery(9), echo, now_ms, dropped=True)
    _flush(producer)

    [(_, retry)] = producer.records[NAMES.retry("webhook", "transactional", "10s")]
    [(_, letter)] = producer.records[NAMES.dlq]
    for headers in (retry, letter):
        assert headers["last_error"] == headers["first_error"] == b"500 http_500"
        assert not any(b"Jane" in v or b"Elm" in v for v in headers.values() if v is not None), headers
    [(attempt, _)] = producer.records[NAMES.webhook_attempts]
    assert b"Jane" not in attempt and b"Elm" not in attempt and b"http_500" in attempt


class RefusingProducer(FakeProducer):
    """Refuses every record carrying a payload to the DLQ for its size (in its batch and alone)."""

    def poll(self, timeout=0):
        acks, self._acks = self._acks, []
        for ack, written in acks:
            refused = written.value() is not None and written.value() == self.refuse
            ack(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE) if refused else None, written)
        return len(acks)


def _email(attempt: int) -> Pending:
    send = build_send(validate_request(email_request()), "acme")
    return Pending(NAMES.lane("email", "transactional"), 0, 3, encode(send), {}, send, attempt)


def _serve(writer: RecordWriter) -> None:
    """Serve the writer's delivery reports, a refused record tried again alone, with no backoff waits."""
    for _ in range(10):
        for outage in writer.writer.outages.values():
            outage.next_try_at = 0.0
        writer.writer.poll(0)


def _dead_letters(reason: str) -> float:
    return REGISTRY.get_sample_value("dispatch_dead_letters_total",
                                     {"channel": "email", "lane": "transactional", "reason": reason}) or 0.0


def test_a_dead_letter_written_before_an_attempt_counts_only_the_attempts_made():
    """Given an OTP found too old before its first attempt, and another before its third,
    When each is dead-lettered `too_old`,
    Then the letter and its outcome event say 0 and 2 attempts (the retrier counts alike); a send whose request
    went out with its outcome unknown counts that attempt."""
    producer = FakeProducer()
    writer = RecordWriter(producer, NAMES, "email", "transactional", "resend", NAMES.lane("email", "transactional"),
                          "g")
    now_ms = int(time.time() * 1000)
    for attempt in (1, 3):
        writer.dead_letter(_email(attempt), "too_old", None, now_ms, lambda: None)
    writer.dead_letter(_email(2), "unknown_outcome", None, now_ms, lambda: None, attempted=True)
    _flush(producer)
    assert [h["attempts"] for _, h in producer.records[NAMES.dlq]] == [b"0", b"2", b"2"]
    assert [orjson.loads(v)["attempts"] for v, _ in producer.records[NAMES.outcomes]] == [0, 2, 2]


def test_a_webhook_delivery_dropped_before_an_attempt_is_said_on_the_attempts_topic_once_both_are_written():
    """Given a webhook delivery found past its max age before its 4th attempt,
    When it is dead-lettered `too_old`,
    Then an attempt event says it was dropped (`not_attempted`, reason too_old, after 3 attempts) for the endpoint
    health app to tell the tenant (before: only deliveries dropped after an attempt were said, and no "Webhook
    event dropped" email went out), and the message is finished only once the letter, its outcome and that
    event are all acknowledged."""
    writer, producer = _writer()
    finished = []
    writer.dead_letter(_delivery(4), "too_old", None, int(time.time() * 1000), lambda: finished.append(1))
    producer.poll()  # the letter and the attempt event: the outcome (written once the letter is) is not yet
    assert finished == []
    _flush(producer)

    assert finished == [1]
    [(value, _)] = producer.records[NAMES.webhook_attempts]
    event = orjson.loads(value)
    assert (event["outcome"], event["dropped"], event["n"], event["endpoint_id"]) == ("not_attempted", "too_old",
                                                                                      3, "ep_1")
    writer.dead_letter(_delivery(2), "malformed", None, int(time.time() * 1000), lambda: None)  # never a delivery
    _flush(producer)
    assert len(producer.records[NAMES.webhook_attempts]) == 1


def test_a_dead_letter_refused_for_its_size_is_counted_once_as_too_large():
    """Given a broker that refuses a dead letter with its payload for its size,
    When a send is dead-lettered `retries_exhausted`, and an event that never became a send `malformed`,
    Then each is kept without its payload (reason too_large) and counted once in dispatch_dead_letters_total,
    as too_large (the reason `streams dlq list --reason` finds it under), not also under its first reason."""
    producer = RefusingProducer()
    writer = RecordWriter(producer, NAMES, "email", "transactional", "resend", NAMES.lane("email", "transactional"),
                          "g")
    before = {r: _dead_letters(r) for r in ("retries_exhausted", "malformed", "too_large")}
    p = _email(3)
    producer.refuse = p.raw
    writer.dead_letter(p, "retries_exhausted", ProviderResult("unavailable", 500, error_name="http_500"),
                       int(time.time() * 1000), lambda: None)
    _serve(writer)
    raw = _email(1)
    producer.refuse = raw.raw
    writer.dead_letter_raw(FakeMessage(0, 4, raw.raw), {}, "malformed", "a test", lambda: None)
    _serve(writer)
    kept = [h for v, h in producer.records[NAMES.dlq] if v is None]
    assert [h["reason"] for h in kept] == [b"too_large", b"too_large"]
    assert {r: _dead_letters(r) - before[r] for r in before} == {"retries_exhausted": 0, "malformed": 0,
                                                                  "too_large": 2}


class RefusesHugeHeaders(FakeProducer):
    """Refuses, as too large, every record carrying a header named `huge`."""

    def produce(self, topic, value=None, key=None, headers=None, on_delivery=None):
        headers = dict(headers or [])
        if "huge" not in headers:
            return super().produce(topic, value, key, headers, on_delivery)
        self._acks.append((lambda err, msg: on_delivery(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE), msg),
                           FakeMessage(0, 0, value)))


def test_a_dead_letter_kept_with_dispatch_s_headers_only_still_says_how_many_attempts_were_declined():
    """Given a send whose copy carries a header too large for the broker (set by its producer), throttled by its
    provider twice on its way (`declined: 2`),
    When it is dead-lettered, the letter refused with its payload and again without it,
    Then the letter kept with dispatch's own headers only still carries `declined` next to `attempts` (an operator
    reading attempts=7 under a policy of 6 sees why)."""
    producer = RefusesHugeHeaders()
    writer = RecordWriter(producer, NAMES, "webhook", "transactional", "webhook", LANE, "g")
    p = _delivery(7)
    p.headers.update({"huge": b"x" * 2_000, "declined": b"2"})
    writer.dead_letter(p, "too_old", None, int(time.time() * 1000), lambda: None)
    for _ in range(10):
        writer.writer.poll(0)
    [(_, letter)] = producer.records[NAMES.dlq]
    assert letter["headers_omitted"] == b"too_large" and "huge" not in letter
    assert (letter["attempts"], letter["declined"]) == (b"6", b"2")


def test_a_retry_copy_refused_after_a_declined_attempt_is_dead_lettered_counting_that_attempt():
    """Given an email declined by its provider once before (`declined: 1`), whose copy carries a header too large for
    the broker (set by its producer),
    When the provider declines it again (a long 429) and its retry copy is refused as too large,
    Then its letter (`too_large`, refused whole too, kept with dispatch's headers) says `retry_copy_too_large` and that
    2 of its 3 attempts were declined (this one counted; before: 1)."""
    producer = RefusesHugeHeaders()
    lane = NAMES.lane("email", "marketing")
    writer = RecordWriter(producer, NAMES, "email", "marketing", "resend", lane, "g")
    send = build_send(validate_request(email_request()), "acme")
    p = Pending(lane, 0, 5, encode(send), {"huge": b"x" * 2_000, "declined": b"1"}, send, 3, declined=1)
    now_ms = int(time.time() * 1000)
    writer.retry(p, RetryAt("1h", now_ms + 3_600_000, "rate_limited", declined=True),
                 ProviderResult("throttled", 429, retry_after="3600"), now_ms, lambda: None, ["resend"])
    for _ in range(10):
        writer.writer.poll(0)
    [(_, letter)] = producer.records[NAMES.dlq]
    assert (letter["reason"], letter["reason_detail"]) == (b"too_large", b"retry_copy_too_large")  # kept bounded
    assert (letter["attempts"], letter["declined"]) == (b"3", b"2")
