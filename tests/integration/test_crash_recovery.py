"""kill -9 of a worker while the provider holds its requests: after a restart every send is
delivered exactly once, and the requests the kill left without a known outcome are re-sent under
their own idempotency keys (the provider answers from its store instead of delivering again)."""

import signal

from tests.harness import committed_lag, email_request, wait_until

BLAST = 3_000


def test_worker_killed_with_requests_in_flight_then_restarted_delivers_each_send_once(
        stack, names, channel_topics, limits, processes, send_client, mock_provider):
    """Given a 3,000-email blast from three tenants and one marketing worker,
    When the provider has accepted some requests but holds their answers and the worker is killed
    with kill -9 at that moment, and a new worker starts,
    Then every send is delivered exactly once, only through the batch endpoint, and the held
    requests were re-sent under their own keys (idempotent replays at the provider)."""
    channel_topics("email", lane_partitions=3)
    mock_provider.reset(rate=40, latency_ms=50)
    limits.set_provider("resend", 10, 10)  # 30 requests: a burst of 10 (the first third), then 10 a second
    limits.set_tenant("resend", "*", 100_000, 100)
    for i in range(3):
        send_client.publish_batch(f"tenant-{i}", [email_request("marketing")] * (BLAST // 3))

    # The provider answers the first third of the blast, then holds the answer of every request it accepts.
    # Switching the hold on from here raced the worker, which could send the whole blast before it; past the
    # cut the gate lets one request out every 100 ms, so the kill (at the first held request) leaves most unsent.
    mock_provider.configure(hold_answers_after=BLAST // 3)
    first = processes.worker("email", "marketing")
    wait_until(lambda: mock_provider.stats()["held"] >= 1, 60, "the provider to hold an accepted request")
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    held_at_kill = mock_provider.stats()["held"]
    delivered_at_kill = mock_provider.stats()["messages_delivered"]
    mock_provider.configure(hold_answers_after=0, hold_answers=False)  # the dead worker's connections get answers
    assert BLAST // 3 < delivered_at_kill < BLAST  # answered, accepted with the answer held, never sent

    processes.worker("email", "marketing")
    group, topic = names.group("email", "marketing"), names.lane("email", "marketing")
    wait_until(lambda: committed_lag(stack.bootstrap, group, topic) == 0, 120,
               "the restarted worker to commit the whole blast", interval=0.5)

    stats = mock_provider.stats()
    assert stats["distinct_sends"] == BLAST
    assert stats["duplicate_deliveries"] == 0, stats["duplicated_sends"]
    assert stats["single_email_requests"] == 0
    assert held_at_kill >= 1 and stats["idempotent_replays"] >= 1
