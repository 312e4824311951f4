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




def test_reading_how_overdue_a_retry_tier_is_fetches_little_of_its_backlog(stack, namespace, names, create_topics):
    """Given a retry tier with 10 MB of copies waiting in its one partition (a blast's failures), all overdue,
    When the retry tier watch reads how overdue its first waiting copy is,
    Then it says so, and its peek fetched a few of those megabytes at most (before: it took 500 copies a call,
    waiting for them, 5 MB here, and a whole smaller backlog at every read)."""
    import orjson

    from streams.lag.retry_watch import RetryTierWatch

    topic, group = f"{namespace}tier", f"{namespace}group"
    create_topics({topic: 1})
    producer = Producer({"bootstrap.servers": stack.bootstrap, "linger.ms": 50})
    due_ms = int(time.time() * 1000) - 30_000
    for i in range(1_000):  # 10 kB each
        producer.produce(topic, i.to_bytes(4, "big") * 2_500, headers={"due_at_ms": str(due_ms).encode()})
    assert producer.flush(30) == 0
    stats: list[dict] = []
    peeker = lag_reader.head_peeker(stack.bootstrap, f"{namespace}peek", {
        "statistics.interval.ms": 100, "stats_cb": lambda text: stats.append(orjson.loads(text))})
    reader = LagReader(stack.bootstrap)
    try:
        watch = RetryTierWatch(stack.bootstrap, names, ("email",))
        assert 25 <= watch._overdue(peeker, topic, reader.positions(group, topic)) < 90
        # The statistics are cumulative (the messages the peek was handed): wait for three more after the read.
        seen, deadline = len(stats), time.monotonic() + 30
        while len(stats) < seen + 3 and time.monotonic() < deadline:
            peeker.poll(0.1)
    finally:
        reader.close()
        peeker.close()
    assert len(stats) >= seen + 3, "no statistics came from the peeker"
    fetched = stats[-1]["rxmsg_bytes"]
    assert 10_000 <= fetched < 4_000_000, f"the peek was handed {fetched} bytes of a 10 MB backlog"


def test_reading_a_paused_lanes_lag_again_fetches_none_of_its_backlog(stack, namespace, create_topics):
    """Given a lane with 4 MB of sends waiting in its one partition, its group's position not moving (a marketing
    lane paused behind a blast),
    When its lag is read, then read again (the lag monitor reads every lane four times a second),
    Then both readings give the waiting messages and their age, and the second fetches none of the backlog (before:
    each read fetched a megabyte or more of it again, four times a second, on the broker shared with the sends)."""
    import orjson

    topic, group = f"{namespace}lane", f"{namespace}group"
    create_topics({topic: 1})
    producer = Producer({"bootstrap.servers": stack.bootstrap, "linger.ms": 50})
    sent_ms = int(time.time() * 1000) - 20_000
    for i in range(400):  # 10 kB each
        producer.produce(topic, i.to_bytes(4, "big") * 2_500, timestamp=sent_ms)
    assert producer.flush(30) == 0
    stats: list[dict] = []
    reader = LagReader(stack.bootstrap)
    reader.peeker.close()
    reader.peeker = lag_reader.head_peeker(stack.bootstrap, f"{namespace}peek", {
        "statistics.interval.ms": 100, "stats_cb": lambda text: stats.append(orjson.loads(text))})

    def handed_after(read) -> tuple[object, int]:
        """A read's result, and the bytes the peeker was handed in all once three more statistics came after it."""
        result = read()
        seen, deadline = len(stats), time.monotonic() + 30
        while len(stats) < seen + 3 and time.monotonic() < deadline:
            reader.peeker.poll(0.1)
        assert len(stats) >= seen + 3, "no statistics came from the peeker"
        return result, stats[-1]["rxmsg_bytes"]

    try:
        first, after_first = handed_after(lambda: reader.read(group, topic))
        second, after_second = handed_after(lambda: reader.read(group, topic))
    finally:
        reader.close()
    assert first.lag_messages == second.lag_messages == 400
    assert 19 <= first.lag_seconds <= second.lag_seconds < 60
    assert after_first >= 10_000, f"the first read fetched {after_first} bytes: its head not read"
    assert after_second == after_first, f"the second read fetched {after_second - after_first} bytes of the backlog"
