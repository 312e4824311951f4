"""kill -9 of a worker in the middle of a blast: after a restart every send is delivered exactly once."""

import signal

from tests.conftest import committed_lag, email_request, wait_until

BLAST = 3_000


def test_worker_killed_mid_blast_then_restarted_delivers_each_send_once(
        stack, names, channel_topics, limits, processes, send_client, mock_provider):
    channel_topics("email", lane_partitions=3)
    # Slow answers keep requests in flight, so the kill lands between "sent" and "recorded".
    mock_provider.reset(rate=40, latency_ms=300)
    limits.set_provider("resend", 40, 40)
    limits.set_tenant("resend", "*", 100_000, 100)
    for i in range(3):
        send_client.publish_batch(f"tenant-{i}", [email_request("marketing")] * (BLAST // 3))

    first = processes.worker("email", "marketing")
    wait_until(lambda: mock_provider.stats()["messages_delivered"] >= BLAST // 3, 60,
               "a third of the blast to be delivered")
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    delivered_at_kill = mock_provider.stats()["messages_delivered"]
    assert delivered_at_kill < BLAST

    processes.worker("email", "marketing")
    group, topic = names.group("email", "marketing"), names.lane("email", "marketing")
    wait_until(lambda: committed_lag(stack.bootstrap, group, topic) == 0, 120,
               "the restarted worker to commit the whole blast", interval=0.5)

    stats = mock_provider.stats()
    assert stats["distinct_sends"] == BLAST
    assert stats["duplicate_deliveries"] == 0, stats["duplicated_sends"]
    assert stats["single_email_requests"] == 0
    # The kill left requests without a known outcome; they were re-sent under their own keys and
    # the provider answered from its idempotency store instead of delivering again.
    assert stats["idempotent_replays"] >= 1
