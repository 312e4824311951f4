"""The outcome recorder skips what it can never record (and says so), and records everything else: a bad
record on notif.outcomes neither stalls it (a field Redis cannot store looked like Redis being down) nor
stops it."""

import orjson
from confluent_kafka import Producer

from streams.ingest.status import StatusStore
from streams.kafka_client import put_acked
from tests.harness import committed_lag, wait_until


def _event(send_id: str, status: str = "delivered", **fields) -> dict:
    return {"send_id": send_id, "tenant_id": "acme", "channel": "email", "lane": "transactional", "status": status,
            "attempts": 1, "provider": "resend", "provider_message_id": "m1", "reason": "",
            "created_at_ms": 1_700_000_000_000, "completed_at_ms": 1_700_000_001_000, **fields}


def test_unusable_outcome_records_are_skipped_and_the_rest_recorded(stack, channel_topics, names, processes,
                                                                     redis_client, namespace):
    """Given records on notif.outcomes written by someone else: one not JSON; a request's record holding an
    event whose tenant is null between two good ones; an event whose provider is a list; a webhook event
    whose status is a number; a webhook event whose attempt is nested 300 levels deep (readable, but past what
    can be written back: before, it stopped the recorder, restarting on it for good); and a good event after them,
    When the outcome recorder reads them,
    Then every good event's status is recorded, the unusable ones are skipped with one log line each
    naming the field and the offset, the recorder keeps running, and it commits to the topic's end."""
    channel_topics("email")
    producer = Producer({"bootstrap.servers": stack.bootstrap})

    def put(value: bytes) -> None:
        put_acked(producer, names.outcomes, b"k", value, 10, "an outcome record")

    put(b"{not json")
    put(orjson.dumps({"events": [_event("s-1"), _event("s-bad-tenant", tenant_id=None), _event("s-2")]}))
    put(orjson.dumps(_event("s-bad-provider", provider=["resend"])))
    put(orjson.dumps(_event("s-bad-status", status=5, endpoint_id="ep_1")))
    deep = orjson.dumps(_event("s-deep-attempt", endpoint_id="ep_1", attempt={"n": 1, "x": "DEEP"}))
    put(deep.replace(b'"DEEP"', b"[" * 300 + b"]" * 300))
    put(orjson.dumps(_event("s-3", status="dead_lettered", reason="retries_exhausted")))
    recorder = processes.start("outcome-recorder", "outcome-recorder", ready="outcome recorder consuming")
    store = StatusStore(redis_client, namespace)

    wait_until(lambda: all(store.get(s) for s in ("s-1", "s-2", "s-3")), 30, "the good events to be recorded")
    assert [store.get(s)["status"] for s in ("s-1", "s-2", "s-3")] == ["delivered", "delivered", "dead_lettered"]
    assert all(store.get(s) is None for s in ("s-bad-tenant", "s-bad-provider", "s-bad-status", "s-deep-attempt"))
    wait_until(lambda: committed_lag(stack.bootstrap, names.recorder_group, names.outcomes) == 0, 30,
               "the recorder to commit to the end")
    log = processes.logs(tail=100_000)
    skipped = [line for line in log.splitlines() if "skipping an unusable outcome" in line]
    assert len(skipped) == 5, log
    assert any("not JSON" in line for line in skipped) and any("'tenant_id'" in line for line in skipped)
    assert any("'provider'" in line for line in skipped) and any("'status'" in line for line in skipped)
    assert any("'attempt' is nested too deep" in line for line in skipped)
    assert recorder.poll() is None
