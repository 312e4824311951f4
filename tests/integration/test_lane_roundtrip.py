"""A message produced to a lane topic is consumed by a consumer group and its offset committed."""

import uuid

from confluent_kafka import Consumer, Producer, TopicPartition


def test_lane_message_is_consumed_and_committed(stack, names, create_topics):
    """Given a transactional email lane topic with 3 partitions,
    When one message is produced with an idempotent producer and read by the lane's consumer group,
    Then the same key and value come back and the committed offset is the one right after that message."""
    topic = names.lane("email", "transactional")
    create_topics({topic: 3})
    group = names.group("email", "transactional")
    key, value = b"tenant-a", f"send-{uuid.uuid4()}".encode()

    producer = Producer({"bootstrap.servers": stack.bootstrap, "enable.idempotence": True, "acks": "all"})
    producer.produce(topic, key=key, value=value)
    assert producer.flush(10) == 0

    consumer = Consumer({
        "bootstrap.servers": stack.bootstrap, "group.id": group, "auto.offset.reset": "earliest",
        "enable.auto.commit": False, "partition.assignment.strategy": "cooperative-sticky",
    })
    consumer.subscribe([topic])
    try:
        msg = None
        for _ in range(60):  # bounded: 60 polls of up to 1 s
            msg = consumer.poll(1.0)
            if msg is not None and not msg.error():
                break
        assert msg is not None and msg.value() == value and msg.key() == key
        consumer.commit(message=msg, asynchronous=False)
        committed = consumer.committed([TopicPartition(topic, msg.partition())], timeout=10)
        assert committed[0].offset == msg.offset() + 1
    finally:
        consumer.close()
