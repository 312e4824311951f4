"""Redis loses its data under a running worker: its next claim, not the state guard's next periodic
look, stops dispatch. A delivered send met again (its producer published it twice) finds no
delivery mark in the emptied Redis; without this it would go out a second time, in a request of
its own whose idempotency key the provider has not seen (the first went out in a batch)."""

import threading

from confluent_kafka import Producer

import streams.state.guard as guard_module
from streams.names import RedisKeys
from streams.send import build_send, encode, validate_request
from tests.harness import email_request, wait_until


def test_a_claim_in_an_emptied_redis_holds_dispatch_before_the_guard_looks_again(
        fault_stack, fault_runtime, fault_topics, mock_provider, names, namespace, monkeypatch):
    """Given a marketing email worker whose state guard would look at Redis again only in an hour, and two
    emails it has delivered in one batch request,
    When Redis loses its data, an operator sets the limits again, and one of the emails' event arrives a
    second time (alone: a request under a key the provider has not seen),
    Then the worker's claim finds Redis without its epoch, leaves nothing claimed, and the worker holds
    with its guard reporting the loss: the email was delivered once."""
    monkeypatch.setattr(guard_module, "CHECK_EVERY_S", 3600.0)
    fault_topics("email")
    mock_provider.reset(rate=50)
    limits = fault_runtime.limit_store()

    def set_limits() -> None:
        limits.set_provider("resend", 100, 100)
        limits.set_tenant("resend", "*", 100, 100)

    set_limits()
    send, other = (build_send(validate_request(email_request("marketing")), "acme") for _ in range(2))
    producer = Producer({"bootstrap.servers": fault_stack.bootstrap})

    def publish(*sends) -> None:
        for s in sends:
            producer.produce(names.lane("email", "marketing"), key=b"acme", value=encode(s))
        assert producer.flush(10) == 0

    def deliveries() -> int:
        return len(mock_provider.stats(deliveries=True)["deliveries"].get(send.send_id, []))

    processed = RedisKeys(namespace).processed("acme", send.send_id)
    redis = fault_stack.redis()
    publish(send, other)  # before the worker starts: both come in its first fetch, one batch request
    worker = fault_runtime.worker("email", "marketing")
    stop = threading.Event()
    runner = threading.Thread(target=worker.run, kwargs={"until": stop.is_set}, daemon=True)
    runner.start()
    try:
        wait_until(lambda: redis.get(processed) == b"delivered", 30, "the first copy delivered and marked")
        assert deliveries() == 1

        fault_stack.lose_redis_data()
        redis = fault_stack.redis()
        set_limits()
        publish(send)

        wait_until(lambda: worker.guard.lost or deliveries() > 1, 30, "the second copy to be held or sent")
        assert deliveries() == 1, "the send went out again from an emptied Redis"
        assert worker.guard.lost
        assert redis.get(processed) is None, "a claim made in the emptied Redis was left behind"
        assert worker.queues.buffered == 1, "the second copy is held, not dropped"
    finally:
        stop.set()
        runner.join(60)
