"""Retry messages held by a retrier whose partitions move to a second retrier and back are still
released when due, once each: a rebalance forgets nothing that matters and leaves no partition
paused or stranded."""

import signal
import time

from confluent_kafka import Consumer, Producer, TopicPartition

from streams.lanes import RETRY_TIERS
from streams.send import build_send, encode, validate_request
from tests.harness import free_port, metric, read_topic, sms_request, wait_until

DUE_IN_MS = 45_000  # the second retrier joins and leaves well before, however loaded the machine
SLACK_MS = 2_000


def _held(port: int) -> float:
    return sum(metric(port, "dispatch_retry_held_messages", tier=t) or 0 for t in RETRY_TIERS)


def test_held_retry_messages_survive_their_partitions_moving_away_and_back(
        fault_stack, fault_runtime, fault_topics, fault_processes, names):
    """Given a retrier holding eight SMS retry messages (one per tier topic, each due in 45 s),
    When a second retrier joins (taking some of those partitions and their messages) and leaves again before
    they are due, so the partitions return to the first retrier,
    Then every message is re-published to the lane exactly once, never early and at most 2 s late."""
    fault_topics("sms", lane_partitions=1)
    first_port, second_port = free_port(), free_port()
    fault_processes.start("retrier-1", "retrier", "--channel", "sms", "--lane", "transactional",
                          "--metrics-port", str(first_port), ready="retrier consuming")
    due = int(time.time() * 1000) + DUE_IN_MS
    producer = Producer({"bootstrap.servers": fault_stack.bootstrap})
    expected = {}
    for tier in RETRY_TIERS:
        send = build_send(validate_request(sms_request()), "acme")
        expected[send.send_id] = encode(send)
        producer.produce(names.retry("sms", "transactional", tier), key=b"acme", value=encode(send),
                         headers=[("due_at_ms", str(due).encode()), ("attempt", b"2"),
                                  ("send_id", send.send_id.encode())])
    producer.flush(10)
    wait_until(lambda: _held(first_port) == len(RETRY_TIERS), 20, "the first retrier to hold all eight")

    second = fault_processes.start("retrier-2", "retrier", "--channel", "sms", "--lane", "transactional",
                                   "--metrics-port", str(second_port), ready="retrier consuming")
    wait_until(lambda: _held(second_port) > 0 and _held(first_port) < len(RETRY_TIERS), 20,
               "some partitions (and their messages) to move to the second retrier")
    second.send_signal(signal.SIGTERM)
    assert second.wait(30) == 0
    assert time.time() * 1000 < due, "the second retrier must leave before the messages are due"
    wait_until(lambda: _held(first_port) == len(RETRY_TIERS), 20, "the partitions to come back")

    copies = read_topic(fault_stack.bootstrap, names.lane("sms", "transactional"), expect=len(RETRY_TIERS),
                        timeout=DUE_IN_MS / 1000 + 15)
    by_id = {}
    for m in copies:
        send_id = dict(m.headers())["send_id"].decode()
        by_id.setdefault(send_id, []).append(m)
    assert set(by_id) == set(expected)
    assert all(len(ms) == 1 for ms in by_id.values()), {k: len(v) for k, v in by_id.items() if len(v) > 1}
    for send_id, [m] in by_id.items():
        assert m.value() == expected[send_id]
        assert 0 <= m.timestamp()[1] - due <= SLACK_MS
    lane = names.lane("sms", "transactional")
    c = Consumer({"bootstrap.servers": fault_stack.bootstrap, "group.id": "probe"})
    assert c.get_watermark_offsets(TopicPartition(lane, 0), timeout=10)[1] == len(RETRY_TIERS)  # nothing twice
    c.close()
