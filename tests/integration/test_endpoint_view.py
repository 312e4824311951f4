"""The endpoint view that ingest fans out with: a process that acts on a request first brings its view up
to the topics' ends, so it never fans out to an endpoint state older than one another process already
showed the client (the bulk process serves batches while the API process answers `GET /v1/endpoints`)."""

import threading

import orjson
from confluent_kafka import Producer

from streams.kafka_client import put_acked
from streams.webhooks.endpoints import EndpointDirectory

FOLLOW_EVERY_S = 1.0  # slower than ingest's 0.1 s, so the view would lag without the sync


def test_a_synced_view_holds_a_state_published_a_moment_before(stack, channel_topics, names):
    """Given a view followed by a thread polling it every second,
    When an endpoint's health is published (acknowledged) and the view is synced right after,
    Then the sync returns once the view holds that state: degraded, then active again after a second
    publication; and a view that nobody polls tells its caller within the time given."""
    channel_topics("webhook")
    directory = EndpointDirectory(stack.bootstrap, names.operator, names.endpoint_state)
    directory.start()
    stop = threading.Event()

    def follow() -> None:
        while not stop.wait(FOLLOW_EVERY_S):
            directory.poll()

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    try:
        assert directory.sync(30.0)
        for state in ("degraded", "active", "degraded"):
            put_acked(producer, names.endpoint_state, b"ep_view", orjson.dumps(
                {"state": state, "reason": "10 consecutive failures", "since_ms": 1}), 10, "a health record")
            assert directory.sync(30.0)
            assert directory.health["ep_view"].state == state
    finally:
        stop.set()
        follower.join(10)

    put_acked(producer, names.endpoint_state, b"ep_view", orjson.dumps({"state": "active"}), 10, "a health record")
    assert directory.sync(0.5) is False  # nobody polls it any more
    assert directory.health["ep_view"].state == "degraded"
    directory.close()
