"""SIGTERM: the worker finishes its in-flight requests, commits, and leaves the group cleanly."""

import signal

from tests.harness import committed_lag, email_request, wait_until

N = 1_000


def test_sigterm_finishes_in_flight_work_and_commits(stack, names, channel_topics, limits, processes,
                                                    send_client, mock_provider):
    """Given a 1,000-email marketing blast from two tenants on two partitions, a slow provider (400 ms per answer) and
    a worker that has delivered at least 100 of it,
    When the worker receives SIGTERM and a new worker is started afterwards,
    Then the first exits with code 0 having committed its progress but never past an unfinished message, and the new
    one delivers the rest: all 1,000 exactly once, with no idempotent replays (nothing in flight was abandoned)."""
    channel_topics("email", lane_partitions=2)
    mock_provider.reset(rate=20, latency_ms=400)  # slow answers: requests are in flight at SIGTERM
    limits.set_provider("resend", 20, 20)
    limits.set_tenant("resend", "*", 100_000, 10)  # batches of 10: about 100 requests in all
    for i in range(2):
        send_client.publish_batch(f"tenant-{i}", [email_request("marketing")] * (N // 2))
    group, topic = names.group("email", "marketing"), names.lane("email", "marketing")

    worker = processes.worker("email", "marketing")
    wait_until(lambda: mock_provider.stats()["messages_delivered"] >= 100, 60, "the blast to be under way")
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(30) == 0

    # Progress was committed, but never past a message that was not finished: per-tenant queues
    # finish out of order, so the commit stops at the lowest unfinished offset of each partition
    delivered = mock_provider.stats()["messages_delivered"]
    assert delivered < N
    left = committed_lag(stack.bootstrap, group, topic)
    assert N - delivered <= left < N

    # And a new worker picks up from there without re-sending anything
    processes.worker("email", "marketing")
    wait_until(lambda: committed_lag(stack.bootstrap, group, topic) == 0, 90, "the rest to be delivered")
    stats = mock_provider.stats()
    assert stats["distinct_sends"] == N and stats["duplicate_deliveries"] == 0
    # Nothing in flight was abandoned: an abandoned request would leave an unknown outcome that the
    # next worker must re-send under its idempotency key (a replay at the provider)
    assert stats["idempotent_replays"] == 0
