"""A retrier killed between producing and committing loses nothing and causes no duplicate delivery."""

import signal
import time

from confluent_kafka import Producer

from streams.send import build_send, encode, validate_request
from tests.harness import committed_lag, read_topic, sms_request, wait_until

N = 200


def test_retrier_killed_before_commit_then_restarted(stack, names, create_topics, channel_topics, limits,
                                                     processes, mock_provider):
    """Given 200 SMS sends already due on the transactional 10 s retry tier, and a retrier that re-publishes all of
    them to the lane but only commits every 10 minutes,
    When that retrier is killed with kill -9 before committing and a new retrier takes over,
    Then all 200 are re-published a second time (400 copies of 200 distinct sends) and the lane worker still delivers
    each send exactly once."""
    channel_topics("sms", lane_partitions=2)
    limits.set_provider("sms", 500, 500)
    limits.set_tenant("sms", "*", 500, 500)
    tier = names.retry("sms", "transactional", "10s")
    lane = names.lane("sms", "transactional")
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    due = str(int(time.time() * 1000)).encode()
    for _ in range(N):
        send = build_send(validate_request(sms_request()), "acme")
        producer.produce(tier, key=b"acme", value=encode(send),
                         headers=[("due_at_ms", due), ("attempt", b"2"), ("send_id", send.send_id.encode())])
    producer.flush(10)

    # Given a retrier that re-publishes everything but has not committed (commits every 10 min)
    first = processes.retrier("sms", "transactional", env={"DUAL_RAIL_COMMIT_INTERVAL_MS": "600000"})
    read_topic(stack.bootstrap, lane, expect=N)
    # When it is killed before committing, and a new one takes over
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    processes.retrier("sms", "transactional")
    copies = read_topic(stack.bootstrap, lane, expect=2 * N, timeout=60)  # everything was re-published again
    assert len({dict(m.headers())["send_id"] for m in copies}) == N

    # Then the lane worker delivers each send exactly once
    processes.worker("sms", "transactional")
    wait_until(lambda: committed_lag(stack.bootstrap, names.group("sms", "transactional"), lane) == 0, 60,
               "the worker to process every copy")
    stats = mock_provider.stats()
    assert stats["distinct_sends"] == N and stats["duplicate_deliveries"] == 0
    assert stats["idempotent_replays"] == 0  # no copy was sent again (the mock answers those from its store)
