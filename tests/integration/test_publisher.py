"""The ingest publisher's single-record path outlives a caller that stops waiting for its send."""

import pytest

from streams.ingest.publisher import Publisher, Record


def test_a_caller_that_stops_waiting_does_not_stop_every_later_send(stack, create_topics, namespace):
    """Given the ingest publisher (its single sends are acknowledged by one thread serving delivery reports),
    When a caller stops waiting for a send before the broker acknowledged it (asyncio.wrap_future cancels the
    send's future when the task awaiting publish_async is cancelled, by a timeout around it),
    Then the next send is acknowledged, after the abandoned one (before: the abandoned send's report raised on
    that thread and ended it; every later single send of the process waited until its timeout)."""
    topic = f"{namespace}publisher-check"
    create_topics({topic: 1})
    publisher = Publisher(stack.bootstrap, timeout_s=5)
    try:
        publisher.publish([Record(topic, b"first", b"v")])  # the topic's size limit is known from here on
        for i in range(50):  # until one is abandoned before its acknowledgement came (the first, all but always)
            if publisher._single(Record(topic, f"abandoned-{i}".encode(), b"v"), 0.0).cancel():
                break
        else:
            pytest.fail("every send was acknowledged before its caller could stop waiting")
        [written] = publisher.publish([Record(topic, b"next", b"v")])
        assert written.topic == topic and written.offset == i + 2
    finally:
        publisher.close()


def test_nothing_to_publish_asks_nothing_of_the_broker():
    """Given the ingest publisher and no broker at its address,
    When it is given no records (a webhook event no endpoint subscribes to),
    Then it answers at once that nothing was written (before: it ran an empty transaction, which failed after its
    timeout: the event was answered 503 for nothing)."""
    import asyncio

    publisher = Publisher("127.0.0.1:1", timeout_s=2)
    try:
        assert publisher.publish([]) == []
        assert asyncio.run(publisher.publish_async([])) == []
    finally:
        publisher.close()


@pytest.mark.parametrize("batch", [False, True], ids=["single", "batch"])
def test_a_send_the_broker_refuses_as_too_large_is_refused_by_size_on_its_retry(stack, create_topics, namespace,
                                                                              batch):
    """Given the ingest publisher, which knows a topic's size limit (read, cached for a minute), and an operator who
    then lowers the topic's max.message.bytes,
    When a send over the new limit (under the cached one) is published, alone or in a batch (one transaction), and
    then again,
    Then the first attempt fails unpublished (a 503: the broker refuses the producer's whole batch, which may hold
    other, small sends) and the cached limit is dropped, so the retry is checked against the new one before it is
    produced and refused as too large (RecordTooLarge: the API answers 413 naming the send; before, every retry was
    a 503 "retry after a moment" that no retry could pass, for a minute at a time)."""
    from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource

    from streams.errors import PublishError
    from streams.ingest.publisher import RecordTooLarge
    from tests.harness import wait_until

    topic = f"{namespace}publisher-sizes"
    create_topics({topic: 1})
    publisher = Publisher(stack.bootstrap, timeout_s=5)
    admin = AdminClient({"bootstrap.servers": stack.bootstrap})
    try:
        publisher.publish([Record(topic, b"first", b"v")])  # the topic's size limit is known from here on
        change = ConfigResource(ConfigResource.Type.TOPIC, topic, incremental_configs=[
            ConfigEntry("max.message.bytes", "1000", incremental_operation=AlterConfigOpType.SET)])
        for f in admin.incremental_alter_configs([change]).values():
            f.result()

        def lowered() -> bool:
            [described] = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, topic)]).values()
            return described.result()["max.message.bytes"].value == "1000"

        wait_until(lowered, 30, "the broker to apply the lower limit")
        records = [Record(topic, b"small", b"v")] * batch + [Record(topic, b"big", b"x" * 5000)]
        refusal = "the batch was not published" if batch else "refused the send's batch as too large"
        with pytest.raises(PublishError, match=refusal) as refused:
            publisher.publish(records)
        assert not isinstance(refused.value, RecordTooLarge)
        with pytest.raises(RecordTooLarge, match="accepts at most 1000"):  # checked before producing now
            publisher.publish(records)
    finally:
        publisher.close()
