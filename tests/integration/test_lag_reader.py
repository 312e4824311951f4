"""The lag reader on the real broker: what it reads when a group's position is a transaction's marker."""

import time

from confluent_kafka import Consumer, Producer, TopicPartition

from streams.lag import reader as lag_reader
from streams.lag.reader import LagReader


def test_a_group_positioned_on_a_transaction_marker_reads_without_waiting_and_with_age_0(stack, namespace,
                                                                                          create_topics, monkeypatch):
    """Given a lane whose one record was published in a transaction (as ingest publishes batches) and whose group
    committed past it, so that its position is the transaction's commit marker (an offset the broker counts,
    never returned as a message),
    When the lag is read,
    Then it is 1 message (the marker) of age 0 s, read without waiting out the peek's time (the end of the
    partition answers for it), not a failure."""
    monkeypatch.setattr(lag_reader, "PEEK_S", 5.0)
    topic, group = f"{namespace}lane", f"{namespace}group"
    create_topics({topic: 1})
    producer = Producer({"bootstrap.servers": stack.bootstrap, "transactional.id": f"{namespace}txn"})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(topic, b"send")
    producer.commit_transaction(30)
    consumer = Consumer({"bootstrap.servers": stack.bootstrap, "group.id": group, "enable.auto.commit": False,
                         "isolation.level": "read_committed"})
    consumer.assign([TopicPartition(topic, 0, 0)])
    message = consumer.poll(30)
    assert message is not None and not message.error()
    consumer.commit(offsets=[TopicPartition(topic, 0, message.offset() + 1)], asynchronous=False)
    consumer.close()

    reader = LagReader(stack.bootstrap)
    try:
        assert (reader.read(group, topic).lag_messages) == 1  # its connections made
        started = time.monotonic()
        reading = reader.read(group, topic)
        took = time.monotonic() - started
    finally:
        reader.close()
    assert (reading.lag_messages, reading.lag_seconds) == (1, 0.0)
    # Before, the peek waited out its deadline (PEEK_S, 5 s here) for the marker; a read takes a few tens of ms
    # here, well under half of it however loaded the machine.
    assert took < 2.5, f"the read waited {took:.2f} s for a head that is a marker"


def test_the_lag_monitor_tells_how_far_behind_the_outcome_recorder_is(stack, names, create_topics):
    """Given an outcome published 400 s ago (its timestamp) that the outcome recorder's group has not consumed,
    When the lag monitor's watch measures the recorder, and again once the group has committed past it,
    Then it exports about 400 s (the OutcomeRecorderBehind alert's figure), then 0."""
    from prometheus_client import REGISTRY

    from streams.lag.retry_watch import RetryTierWatch

    create_topics({names.outcomes: 1})
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    producer.produce(names.outcomes, b'{"send_id": "s-1", "status": "delivered"}',
                     timestamp=int(time.time() * 1000) - 400_000)
    assert producer.flush(30) == 0
    watch, reader = RetryTierWatch(stack.bootstrap, names, ("email",)), LagReader(stack.bootstrap)
    group = {"group": names.recorder_group}
    try:
        watch._measure_outcome_recorder(reader)
        assert 395 <= REGISTRY.get_sample_value("dispatch_outcome_recorder_behind_seconds", group) <= 460
        consumer = Consumer({"bootstrap.servers": stack.bootstrap, "group.id": names.recorder_group,
                             "enable.auto.commit": False})
        consumer.commit(offsets=[TopicPartition(names.outcomes, 0, 1)], asynchronous=False)
        consumer.close()
        watch._measure_outcome_recorder(reader)
        assert REGISTRY.get_sample_value("dispatch_outcome_recorder_behind_seconds", group) == 0
    finally:
        reader.close()
