"""A send published with the SDK has a status from the moment the broker has it: `accepted`, through
notif.outcomes and the outcome recorder (the ingest API writes it itself), never over a later status."""

import orjson
from confluent_kafka import Producer

from streams.ingest.status import StatusStore
from streams.kafka_client import put_acked
from tests.harness import email_request, wait_until


def test_sdk_sends_are_accepted_until_their_first_outcome_and_a_late_accepted_changes_nothing(
        stack, channel_topics, names, processes, redis_client, namespace, send_client):
    """Given the outcome recorder running and no lane worker,
    When the SDK publishes one OTP and a batch of 150 marketing emails (more than one outcome record holds),
    Then each send's status is `accepted` (tenant, channel, lane, when, no attempt yet) without any outcome;
    and when one of them then has a `retrying` outcome and the same batch is published again under its key
    (the same send ids: their `accepted` events come again, after it), that send stays `retrying`."""
    channel_topics("email")
    processes.start("outcome-recorder", "outcome-recorder", ready="outcome recorder consuming")
    client = send_client
    store = StatusStore(redis_client, namespace)

    otp = client.publish("shop", email_request("transactional"))
    batch = client.publish_batch("blaster", [email_request("marketing")] * 150, idempotency_key="spring-sale")

    wait_until(lambda: all(store.get(s) for s in [otp, *batch]), 30, "the sends' statuses")
    first = store.get(otp)
    assert (first["status"], first["tenant_id"], first["channel"], first["lane"], first["attempts"]) == (
        "accepted", "shop", "email", "transactional", 0)
    assert first["accepted_at_ms"] > 0 and first["attempt_history"] == []
    assert {(store.get(s)["status"], store.get(s)["tenant_id"], store.get(s)["lane"]) for s in batch} == {
        ("accepted", "blaster", "marketing")}

    retrying = {"send_id": batch[0], "tenant_id": "blaster", "channel": "email", "lane": "marketing",
                "status": "retrying", "attempts": 1, "provider": "resend", "reason": "http_500",
                "created_at_ms": 1, "completed_at_ms": 2}
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    put_acked(producer, names.outcomes, batch[0].encode(), orjson.dumps(retrying), 10, "an outcome record")
    wait_until(lambda: store.get(batch[0])["status"] == "retrying", 30, "the retrying outcome")
    again = client.publish_batch("blaster", [email_request("marketing")] * 150, idempotency_key="spring-sale")
    assert again == batch
    # Behind the repeated accepted events in their partition (the same key as the batch's first record): once the
    # recorder has this one, it has read them.
    marker = {**retrying, "send_id": "marker", "status": "delivered"}
    put_acked(producer, names.outcomes, batch[0].encode(), orjson.dumps(marker), 10, "an outcome record")
    wait_until(lambda: store.get("marker"), 30, "the recorder to read past the repeated accepted events")
    assert store.get(batch[0])["status"] == "retrying" and store.get(batch[0])["attempts"] == 1
