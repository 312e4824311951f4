"""One acknowledged write on a producer other requests share (the ingest API's reactivations go through
the producer of its single sends): it waits for its own record's acknowledgement, so another record the
producer cannot deliver yet neither delays it nor fails it."""

import time
import uuid

from confluent_kafka import Consumer

from streams.kafka_client import durable_producer, put_acked


def test_a_write_is_confirmed_while_the_shared_producer_holds_a_record_it_cannot_deliver(stack, channel_topics,
                                                                                        names):
    """Given a producer holding a record for a topic that does not exist (librdkafka keeps it for the topic's
    metadata, 30 s),
    When a record is written to an existing topic through the same producer, waiting at most 5 s,
    Then the write returns without error as soon as its own record is acknowledged, and the record is in the
    topic."""
    channel_topics("email")
    producer = durable_producer(stack.bootstrap)
    key = f"put-acked-{uuid.uuid4().hex}".encode()
    producer.produce(f"{names.outcomes}.no-such-topic", b"held")
    producer.poll(0)
    started = time.monotonic()
    try:
        put_acked(producer, names.outcomes, key, b"{}", 5, "a test record")
        took = time.monotonic() - started
    finally:
        producer.purge()
        producer.flush(5)
    assert took < 5
    assert holds_key(stack.bootstrap, names.outcomes, key)


def holds_key(bootstrap: str, topic: str, key: bytes) -> bool:
    """`topic` holds a record with `key` (read from its beginning for up to 30 s)."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"put-acked-check-{uuid.uuid4().hex}",
                  "enable.auto.commit": False, "auto.offset.reset": "earliest"})
    try:
        c.subscribe([topic])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is not None and not m.error() and m.key() == key:
                return True
        return False
    finally:
        c.close()
