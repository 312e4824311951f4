"""A 20,000-message email blast reaches the provider only through the batch endpoint."""

from tests.conftest import committed_lag, email_request, wait_until

BLAST = 20_000


def test_blast_uses_only_the_batch_endpoint(stack, names, channel_topics, limits, processes, send_client,
                                            mock_provider):
    channel_topics("email")
    mock_provider.reset(rate=100)
    limits.set_provider("resend", 100, 100)
    limits.set_tenant("resend", "*", 100_000, 100)
    for start in range(0, BLAST, 1000):
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
