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
