"""The status store on a real Redis: outcomes of one send applied by two writers at once (two outcome recorder
copies reading different partitions, or a recorder and `streams state recover`) end at the final status."""

import pytest
import redis

from streams.ingest.status import StatusStore


class ReadsThenPauses(redis.Redis):
    """A client that, after reading a send's status, lets `meanwhile` run before answering (the other writer
    getting in between this writer's read and its write)."""

    meanwhile = None

    def hget(self, name, key):
        value = super().hget(name, key)
        if key == "status" and self.meanwhile is not None:
            run, self.meanwhile = self.meanwhile, None
            run()
        return value


def _event(status: str, attempts: int, send_id: str = "s-1") -> dict:
    return {"send_id": send_id, "tenant_id": "acme", "channel": "email", "lane": "transactional", "status": status,
            "attempts": attempts, "completed_at_ms": 1_700_000_000_000 + attempts, "provider": "resend"}


def test_a_retrying_outcome_applied_while_another_writer_records_delivered_never_ends_over_it(
        stack, redis_client, namespace):
    """Given a send's `retrying` outcome (attempt 1) applied by one writer and its `delivered` outcome (attempt 2)
    by another, the second getting in just after the first has looked at the current status,
    When both are applied,
    Then the send is `delivered` after 2 attempts. Before, the first writer read the status, then wrote in a
    separate step: it wrote `retrying` over the `delivered` written in between, and the send showed `retrying`
    for good."""
    slow = StatusStore(ReadsThenPauses.from_url(stack.redis_url), namespace)
    other = StatusStore(redis_client, namespace)
    slow.client.meanwhile = lambda: other.record_outcome(_event("delivered", 2))

    slow.record_outcome(_event("retrying", 1))
    if slow.client.meanwhile is not None:  # compared and written in one step: the other writer comes after
        slow.client.meanwhile()

    doc = other.get("s-1")
    assert (doc["status"], doc["attempts"]) == ("delivered", 2), doc


@pytest.mark.parametrize("first, late, ends", [
    ("delivered", "retrying", "delivered"), ("dead_lettered", "retrying", "dead_lettered"),
    ("skipped", "unknown", "skipped"), ("delivered", "dead_lettered", "delivered"),
    ("dead_lettered", "delivered", "delivered"), ("retrying", "dead_lettered", "dead_lettered")])
def test_an_outcome_arriving_late_never_replaces_a_final_status_but_delivered_replaces_any(
        redis_client, namespace, first, late, ends):
    """Given a send's `first` outcome recorded, When an earlier outcome arrives late (`late`), Then the status is
    `ends`: no status replaces a final one, except `delivered` (the provider has it), which nothing replaces."""
    store = StatusStore(redis_client, namespace)
    store.record_outcome(_event(first, 2, "s-late"))
    store.record_outcome(_event(late, 1, "s-late"))
    assert store.get("s-late")["status"] == ends


def test_an_earlier_attempts_outcome_arriving_late_never_replaces_a_later_one(redis_client, namespace):
    """Given a send's `unknown` outcome of attempt 2 recorded, When attempt 1's `retrying` arrives late (its record
    in another partition), Then the status stays `unknown` after 2 attempts (before: `retrying`, 1 attempt); and
    attempt 3's `retrying` is written over it."""
    store = StatusStore(redis_client, namespace)
    store.record_outcome(_event("unknown", 2, "s-order"))
    store.record_outcome(_event("retrying", 1, "s-order"))
    assert (store.get("s-order")["status"], store.get("s-order")["attempts"]) == ("unknown", 2)
    store.record_outcome(_event("retrying", 3, "s-order"))
    assert (store.get("s-order")["status"], store.get("s-order")["attempts"]) == ("retrying", 3)


def test_a_webhook_deliverys_accepted_event_lists_it_under_its_endpoint(redis_client, namespace):
    """Given a webhook delivery whose `accepted` status went through notif.outcomes (ingest's fallback when Redis
    failed right after the publish; a replay's accepted event),
    When the outcome recorder applies that event,
    Then the delivery names its endpoint and is listed under it while it waits its turn (before: the event named
    no endpoint: GET /v1/deliveries/{id} answered 404 and the endpoint's list left it out until its first
    outcome, hours away for a delivery parked behind a slow receiver)."""
    from streams.outcomes import accepted_events
    from streams.send import SendRequest
    from streams.webhooks.fanout import fan_out
    from streams.webhooks.model import Endpoint

    request = SendRequest(channel="webhook", category="transactional", template_id="t", template_version="1",
                          payload={"event_type": "invoice.paid", "occurredAt": "2026-01-01T00:00:00Z", "data": {}})
    event_id, [delivery] = fan_out(request, "acme", [Endpoint("ep_1", "acme", "https://hooks.example/x", ("*",))])
    store = StatusStore(redis_client, namespace)
    [accepted] = accepted_events([delivery], delivery.created_at_ms)
    store.record_outcome(accepted)
    status = store.get(delivery.send_id)
    assert (status["status"], status["endpoint_id"], status["event_id"]) == ("accepted", "ep_1", event_id)
    assert store.endpoint_deliveries_between("ep_1", "acme", 0, delivery.created_at_ms + 1, 10) == [
        (delivery.send_id, delivery.created_at_ms)]


def test_an_outcome_whose_dlq_holds_thousands_of_other_keys_is_recorded_with_where_it_is(redis_client, namespace):
    """An outcome event (another producer's, or a newer version's) whose `dlq` holds 4,000 keys besides its partition
    and offset: recorded, with the dead letter's place and nothing else of it (before: each key became a field of
    the status hash, past what the status script can write: Redis refused it, the recorder took that for an outage
    and retried the record for good, and `state recover` aborted)."""
    store = StatusStore(redis_client, namespace)
    event = {**_event("dead_lettered", 3, "s-wide"), "dlq": {"partition": 2, "offset": 41,
                                                            **{f"k{i}": "v" for i in range(4_000)}}}
    store.record_outcome(event)
    doc = redis_client.hgetall(store.keys.send_status("s-wide"))
    assert doc[b"status"] == b"dead_lettered" and (doc[b"dlq_partition"], doc[b"dlq_offset"]) == (b"2", b"41")
    assert b"dlq_k0" not in doc
