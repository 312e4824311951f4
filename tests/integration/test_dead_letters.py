"""Events that cannot be dispatched go to notif.dlq with a reason; the partition keeps moving."""

from confluent_kafka import Producer

from streams.send import build_send, encode, validate_request
from tests.harness import committed_lag, email_request, read_topic, wait_until


def test_lane_violation_and_malformed_events_are_dead_lettered_and_the_partition_continues(
        stack, names, channel_topics, limits, processes, mock_provider):
    """Given one transactional email partition holding a marketing send, invalid JSON, a schema version 2 event, an SMS
    send, and behind them a valid transactional email,
    When a transactional email worker runs,
    Then only the valid email is delivered, the partition is committed past every bad event, and the four bad events
    are in notif.dlq with reasons lane_violation, malformed, unknown_version and channel_mismatch; the lane violation
    keeps its send id, origin topic, offset, group and byte-identical payload, and the unknown version names schema
    version 2 and its send id."""
    channel_topics("email", lane_partitions=1)
    limits.set_provider("resend", 100, 100)
    limits.set_tenant("resend", "*", 100, 100)
    topic = names.lane("email", "transactional")
    marketing = build_send(validate_request(email_request("marketing")), "acme")
    after = build_send(validate_request(email_request()), "acme")

    # Given, on one partition: a marketing send (never allowed here), garbage, a future schema
    # version, an SMS send, and then a valid transactional send
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    producer.produce(topic, key=b"acme", value=encode(marketing))
    producer.produce(topic, key=b"acme", value=b"{not json")
    producer.produce(topic, key=b"acme", value=b'{"v": 2, "send_id": "future-1"}')
    sms = build_send(validate_request({**email_request(), "channel": "sms",
                                       "payload": {"to": "+14155550123", "body": "x"}}), "acme")
    producer.produce(topic, key=b"acme", value=encode(sms))
    producer.produce(topic, key=b"acme", value=encode(after))
    producer.flush(10)

    processes.worker("email", "transactional")

    # Then the valid send behind them is delivered and the partition is fully committed
    wait_until(lambda: committed_lag(stack.bootstrap, names.group("email", "transactional"), topic) == 0,
               30, "the partition to be committed past every bad event")
    stats = mock_provider.stats(deliveries=True)
    assert list(stats["deliveries"]) == [after.send_id]

    # And each bad event is in the DLQ with its reason, origin and (where known) send id
    dead = read_topic(stack.bootstrap, names.dlq, expect=4)
    by_reason = {dict(m.headers())["reason"].decode(): m for m in dead}
    assert set(by_reason) == {"lane_violation", "malformed", "unknown_version", "channel_mismatch"}
    violation = by_reason["lane_violation"]
    h = dict(violation.headers())
    assert violation.key() == marketing.send_id.encode() and h["send_id"] == marketing.send_id.encode()
    assert h["origin_topic"] == topic.encode() and h["origin_offset"] == b"0"
    assert h["group"] == names.group("email", "transactional").encode()
    assert violation.value() == encode(marketing)  # the payload travels byte-identical
    assert dict(by_reason["unknown_version"].headers())["send_id"] == b"future-1"
    assert b"schema version 2" in dict(by_reason["unknown_version"].headers())["detail"]
