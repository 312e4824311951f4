"""A producer whose local queue stays full (the broker takes nothing) gives up on a record after the
caller's time, saying nothing was written, instead of holding the caller's thread for as long as the
queue stays full. A real librdkafka producer, pointed at an address where no broker listens."""

import time

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer

from streams.errors import PublishError, PublishOutcomeUnknown
from streams.kafka_client import produce, put_acked


@pytest.fixture
def full_producer():
    producer = Producer({"bootstrap.servers": "127.0.0.1:1", "queue.buffering.max.messages": 1,
                         "message.timeout.ms": 60_000, "log_level": 0})
    produce(producer, "orders", b"the one record the queue holds")
    yield producer
    producer.purge()
    producer.poll(0)


def test_a_record_the_full_queue_never_takes_fails_after_the_callers_time(full_producer):
    started = time.monotonic()
    with pytest.raises(KafkaException) as refused:
        produce(full_producer, "orders", b"second", timeout_s=0.3)
    assert refused.value.args[0].code() == KafkaError._QUEUE_FULL
    assert 0.3 <= time.monotonic() - started < 5


def test_put_acked_on_a_full_queue_says_nothing_was_written(full_producer):
    with pytest.raises(PublishError, match="did not take a test record .*nothing was written") as failed:
        put_acked(full_producer, "orders", b"k", b"v", 0.3, "a test record")
    assert not isinstance(failed.value, PublishOutcomeUnknown)
