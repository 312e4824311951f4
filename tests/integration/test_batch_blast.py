"""A 20,000-message email blast reaches the provider only through the batch endpoint."""

from tests.harness import committed_lag, email_request, wait_until

BLAST = 20_000


def test_blast_uses_only_the_batch_endpoint(stack, names, channel_topics, limits, processes, send_client,
                                            mock_provider):
    """Given a 20,000-email marketing blast already published and a provider allowing 100 requests a second,
    When one marketing worker is started and drains the lane,
    Then all 20,000 emails are delivered exactly once and committed, only through the batch endpoint (no single-email
    requests, at least 200 batch requests), and the provider never answers 429."""
    channel_topics("email")
    mock_provider.reset(rate=100)
    limits.set_provider("resend", 100, 100)
    limits.set_tenant("resend", "*", 100_000, 100)
    for _ in range(BLAST // 1000):
        send_client.publish_batch("blaster", [email_request("marketing")] * 1000)

    processes.worker("email", "marketing")
    wait_until(lambda: mock_provider.stats()["messages_delivered"] >= BLAST, 180,
               "the whole blast to be delivered", interval=0.5)
    wait_until(lambda: committed_lag(stack.bootstrap, names.group("email", "marketing"),
                                     names.lane("email", "marketing")) == 0, 30, "the blast to be committed")

    stats = mock_provider.stats()
    assert stats["distinct_sends"] == BLAST and stats["duplicate_deliveries"] == 0
    assert stats["single_email_requests"] == 0
    assert stats["marketing_single_requests"] == 0
    assert stats["batch_email_requests"] >= BLAST // 100
    assert stats["throttled"] == 0
