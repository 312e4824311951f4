"""Retry tiers: never early, on time, and a far-future head on one partition delays no other."""

import time

from confluent_kafka import Producer

from streams.send import build_send, encode, validate_request
from tests.harness import read_topic, sms_request

SLACK_MS = 2000


def test_due_messages_are_republished_on_time_per_partition(stack, names, create_topics, processes):
    """Given a running retrier on a 10 s tier with 3 partitions, holding sends due in 3 s and 3.5 s on partition 0, one
    due in 4 s on partition 1, and on partition 2 a head due in an hour with a send due in 1 s behind it,
    When their due times pass,
    Then the three sends on partitions 0 and 1 are re-published to the lane never early and at most 2 s late,
    byte-identical and still marked attempt 2, while partition 2's sends wait behind their far-future head without
    delaying the others."""
    lane = names.lane("sms", "transactional")
    tier = names.retry("sms", "transactional", "10s")
    create_topics({lane: 3, tier: 3})
    processes.retrier("sms", "transactional", "10s")
    now = int(time.time() * 1000)
    sends = {}
    producer = Producer({"bootstrap.servers": stack.bootstrap})

    def put(partition: int, due_in_ms: int, label: str) -> None:
        send = build_send(validate_request(sms_request()), "acme")
        sends[send.send_id] = (label, now + due_in_ms, encode(send))
        producer.produce(tier, partition=partition, key=b"acme", value=encode(send),
                         headers=[("due_at_ms", str(now + due_in_ms).encode()), ("attempt", b"2"),
                                  ("send_id", send.send_id.encode())])

    put(0, 3000, "p0-first")
    put(0, 3500, "p0-second")
    put(1, 4000, "p1")
    put(2, 3_600_000, "p2-far-future-head")
    put(2, 1000, "p2-behind-the-head")  # due soon, but FIFO: waits behind its partition's head
    producer.flush(10)

    copies = read_topic(stack.bootstrap, lane, expect=3, timeout=20)
    seen = {}
    for m in copies:
        h = dict(m.headers())
        label, due_ms, raw = sends[h["send_id"].decode()]
        seen[label] = m.timestamp()[1] - due_ms
        assert m.value() == raw  # byte-identical payload
        assert h["attempt"] == b"2"
    assert set(seen) == {"p0-first", "p0-second", "p1"}
    for label, late_ms in seen.items():
        assert 0 <= late_ms <= SLACK_MS, f"{label} re-published {late_ms} ms after its due time"
