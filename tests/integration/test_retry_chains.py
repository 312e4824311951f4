"""One send, one retry chain: a lane message read a second time (its worker killed after the retry copy was
acknowledged and before its offset was committed; a rebalance) is stale once its attempt was made, so the
send's attempts are counted once and it is dead-lettered once."""

from confluent_kafka import Producer

from streams.names import RedisKeys
from streams.retry.dlq import read_all
from streams.send import build_send, encode, validate_request
from tests.harness import THREE_ATTEMPTS_10S_POLICIES as POLICIES
from tests.harness import committed_lag, sms_request, wait_until


def test_a_lane_message_read_again_after_its_attempt_failed_starts_no_second_retry_chain(
        stack, names, namespace, redis_client, channel_topics, limits, processes, mock_provider, tmp_path):
    """Given a policy of 3 attempts 10 s apart, a transactional SMS worker and its retrier, and a provider that
    answers 408 to everything (it never read the request: each attempt's sends are released),
    When a send's first attempt has failed, its retry copy is durable, and its lane message is then read again
    (published again, byte for byte, as a worker that died before committing its offset would meet it),
    Then the provider sees exactly 3 attempts and the send has exactly one dead letter, once the lane and the
    retry tier are committed to their ends (before, the message read again was sent again as attempt 1 and
    wrote a second retry copy: 6 attempts and 2 dead letters, one chain possibly delivered after the other was
    dead-lettered)."""
    channel_topics("sms")
    limits.set_provider("sms", 100, 100)
    limits.set_tenant("sms", "*", 100, 100)
    policy_file = tmp_path / "policies.toml"
    policy_file.write_text(POLICIES)
    processes.env["DUAL_RAIL_RETRY_POLICIES"] = str(policy_file)
    mock_provider.configure(fault_408_ratio=1.0)
    processes.worker("sms", "transactional")
    processes.retrier("sms", "transactional")

    send = build_send(validate_request({**sms_request(), "template_id": "receipt"}), "acme")
    lane = names.lane("sms", "transactional")
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    producer.produce(lane, key=b"acme", value=encode(send))
    assert producer.flush(10) == 0
    # Attempt 1 failed and its retry copy is durable (the worker marks the send tried:1 only then; a worker that
    # died before that would leave the send free, and the message read again would be sent again, not lost).
    processed = RedisKeys(namespace).processed("acme", send.send_id)
    wait_until(lambda: redis_client.get(processed) == b"tried:1", 30, "attempt 1 to fail and its copy to be durable")
    producer.produce(lane, key=b"acme", value=encode(send))  # the same message, read again
    assert producer.flush(10) == 0

    group, ten_s = names.group("sms", "transactional"), names.retry("sms", "transactional", "10s")

    def settled() -> bool:
        # In this order: a copy on the tier is written before its lane message is committed, and a copy
        # released from the tier is in the lane before the tier is committed past it.
        return (committed_lag(stack.bootstrap, group, lane) == 0
                and committed_lag(stack.bootstrap, names.retry_group("sms", "transactional"), ten_s) == 0
                and committed_lag(stack.bootstrap, group, lane) == 0
                and bool(read_all(stack.bootstrap, names.dlq, timeout_s=2)))

    wait_until(settled, 120, "the send dead-lettered, the lane and the tier committed to their ends", interval=1.0)
    letters = read_all(stack.bootstrap, names.dlq, timeout_s=2)
    assert [(r.send_id, r.reason, r.headers["attempts"]) for r in letters] == [
        (send.send_id, "retries_exhausted", "3")]
    assert mock_provider.stats()["faults_408"] == 3
