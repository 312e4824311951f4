"""A replay whose publish the broker did not confirm may still be written: the stalled broker reads what
reached it once it runs again. A second replay would be another send id, which nothing deduplicates, so
the replay is reported as unknown under the id it may have been published as, and a bulk replay keeps
its claim on the original (it never replays it again)."""

import time

import pytest

from streams.errors import ReplayOutcomeUnknown
from streams.ingest.sdk import SendClient
from streams.ingest.status import StatusStore
from streams.retry.replay import replay
from streams.webhooks.api import BulkReplayStopped, _stopped, replay_in_turn
from tests.harness import committed_messages, email_request, read_committed


class StallingClient(SendClient):
    """A real client whose publishes meet a stalled broker once `stalling` is set: the stall begins when the
    replay has read its payload (from the same broker) and hands its send over, a moment a test cannot
    time from outside."""

    def __init__(self, *args, stall, **kwargs):
        super().__init__(*args, **kwargs)
        self.stall, self.stalling = stall, False

    def publish_sends(self, sends):
        if self.stalling:
            self.stall()
        return super().publish_sends(sends)


def position_of(bootstrap: str, topic: str, send_id: str) -> tuple[int, int]:
    """(partition, offset) of the record carrying `send_id` in `topic`."""
    [m] = [m for m in committed_messages(bootstrap, topic) if send_id.encode() in m.value()]
    return m.partition(), m.offset()


def test_a_replay_the_broker_did_not_confirm_names_the_id_it_was_published_as_and_keeps_its_claim(
        fault_stack, fault_topics, names, namespace):
    """Given a delivered email send (its lane record is the payload a replay reads), with a client whose
    acknowledgements time out after 5 s,
    When a bulk replay replays it and the broker stalls (SIGSTOP) just as the replay is published,
    Then the bulk replay stops with ReplayOutcomeUnknown, answered 503 "outcome": "unknown" naming a new send
    id; once the broker runs again, the lane holds exactly one replay of the send, under that id (the id a
    user is told to look up is the real one); and the send's replay claim is kept, so no later bulk replay
    replays it a second time."""
    fault_topics("email")
    lane = names.lane("email", "transactional")
    store = StatusStore(fault_stack.redis(), namespace)
    client = StallingClient(fault_stack.bootstrap, names, timeout_s=5.0, stall=fault_stack.freeze_kafka)
    try:
        [send_id] = client.publish_batch("shop", [email_request()])  # also opens the client's connections
        partition, offset = position_of(fault_stack.bootstrap, lane, send_id)
        store.record_outcome({"send_id": send_id, "status": "delivered", "tenant_id": "shop",
                              "completed_at_ms": int(time.time() * 1000), "endpoint_id": "ep",
                              "origin": {"topic": lane, "partition": partition, "offset": offset}})
        client.stalling = True
        try:
            with pytest.raises(BulkReplayStopped) as stopped:
                replay_in_turn(store, [send_id], "shop", ["delivered"], 10,
                               lambda d: replay(fault_stack.bootstrap, names, store, client, d, tenant="shop"))
        finally:
            fault_stack.thaw_kafka()
        unknown = stopped.value.cause
        assert isinstance(unknown, ReplayOutcomeUnknown), repr(unknown)
        replay_id = unknown.replay_id
        answer = _stopped(stopped.value)
        assert answer.status_code == 503 and answer.detail["outcome"] == "unknown"
        assert f"published as delivery {replay_id}" in answer.detail["errors"][0]["msg"]
    finally:
        client.close()
    assert replay_id != send_id

    replays = [e for e in read_committed(fault_stack.bootstrap, lane) if e.get("replay_of") == send_id]
    assert [e["send_id"] for e in replays] == [replay_id]
    assert not store.claim_replay(send_id), "the claim was freed: a later bulk replay would replay it again"
