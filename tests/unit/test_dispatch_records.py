"""What a lane worker writes to Kafka (streams/dispatch/records.py), with an in-memory producer: the headers
of retry copies and dead letters."""

from __future__ import annotations

import time

from streams.dispatch.records import RecordWriter
from streams.dispatch.tenant_queues import Pending
from streams.providers.outcome import ProviderResult
from streams.retry.policy import RetryAt
from streams.send import build_send, encode, validate_request
from tests.harness import webhook_event
from tests.unit.test_worker_loop import NAMES, FakeProducer

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
    Then no header of the retry copy or the dead letter carries the answer (they say status and error class),
    while the tenant's own attempt record keeps the excerpt."""
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
    assert b"Jane Roe" in attempt  # the tenant reads it in its own attempt record
