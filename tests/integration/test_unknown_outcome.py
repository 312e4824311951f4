"""A timeout after the provider may have accepted the request is retried only under the same
idempotency key: the provider answers from its store and the email is not sent twice."""

from tests.harness import committed_lag, email_request, wait_until


def test_late_answer_is_retried_with_the_same_key_and_delivers_once(stack, names, channel_topics, limits,
                                                                    processes, send_client, mock_provider):
    """Given a transactional email worker and its 10 s retrier, and a provider that accepts each request but answers
    after 4 s, past the client's 2 s timeout,
    When one email is published and, after that first late answer, the provider answers on time again,
    Then the retry goes out under the same idempotency key, the provider answers it from its store, and the email is
    delivered exactly once with no idempotency conflict."""
    channel_topics("email")
    limits.set_provider("resend", 100, 100)
    limits.set_tenant("resend", "*", 100, 100)
    # The provider accepts, then answers after the client's 2 s timeout
    mock_provider.configure(fault_timeout_ratio=1.0, timeout_delay_s=4.0)
    processes.worker("email", "transactional")
    processes.retrier("email", "transactional")
    send_id = send_client.publish("acme", email_request())

    wait_until(lambda: mock_provider.stats()["faults_timeout"] == 1, 30, "the first, late-answered attempt")
    mock_provider.configure(fault_timeout_ratio=0.0)

    wait_until(lambda: mock_provider.stats()["idempotent_replays"] >= 1, 60,
               "the retry under the same idempotency key")
    group, lane = names.group("email", "transactional"), names.lane("email", "transactional")
    wait_until(lambda: committed_lag(stack.bootstrap, group, lane) == 0, 30, "the retry to be committed")
    stats = mock_provider.stats(deliveries=True)
    assert len(stats["deliveries"][send_id]) == 1
    assert stats["idempotency_conflicts"] == 0
