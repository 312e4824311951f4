"""A send that keeps failing ends in notif.dlq after exactly its policy's attempts, with its history; a
replay is a new delivery (a new send id carrying `replay_of`), allowed while the payload is kept, and on the
audit trail."""

import subprocess
import sys
import time

import orjson
import pytest
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource

from streams.dispatch.idempotency import Claim, ProcessedJobs, idempotency_key
from streams.errors import BrokerUnavailable, ReplayNotYet, ReplayOutcomeUnknown, ReplayRefused, StoreUnavailable
from streams.ingest.sdk import SendClient
from streams.ingest.status import StatusStore
from streams.kafka_client import durable_producer, put_acked
from streams.outcomes import events_of
from streams.retry.dlq import fetch, read_all
from streams.retry.replay import replay, replay_dead_letter
from streams.send import MAX_SEND_BYTES, build_send, encode, validate_request
from streams.state.audit import AuditLog, cli_actor
from tests.harness import THREE_ATTEMPTS_10S_POLICIES as POLICIES
from tests.harness import committed_messages, count_records, email_request, sms_request, wait_until


def _cli(env, *args):
    return subprocess.run([sys.executable, "-m", "streams.cli", *args], env=env, capture_output=True, text=True)


def test_exhausted_send_is_dead_lettered_with_its_history_then_replayed_as_a_new_send(
        stack, names, namespace, channel_topics, limits, processes, send_client, mock_provider, tmp_path,
        dispatch_env, redis_client):
    """Given retry policies allowing 3 attempts with a 10 s tier, a transactional SMS worker, its retrier and the
    outcome recorder, and a provider that answers 408 to everything (it never read the request: a 500 would
    leave the outcome unknown, and the send would end `unknown_outcome`),
    When one SMS send is published, and after it is dead-lettered the provider recovers and an operator replays it,
    Then the send lands once in notif.dlq after exactly 3 attempts (reason retries_exhausted, with its send id,
    tenant, channel and the last 408 error), its status went through `retrying` and shows 3 attempts with their
    status and duration; the replay is a new send with a new id and `replay_of` set, delivered once (the original
    id is never sent again); a delivered send can be replayed too; both replays are on the audit trail; `dlq show` does not reveal the phone number;
    replaying an unknown id, or a send whose payload is older than 7 days, fails saying why."""
    channel_topics("sms")
    limits.set_provider("sms", 100, 100)
    limits.set_tenant("sms", "*", 100, 100)
    policy_file = tmp_path / "policies.toml"
    policy_file.write_text(POLICIES)
    processes.env["DUAL_RAIL_RETRY_POLICIES"] = str(policy_file)
    env = {**dispatch_env, "DUAL_RAIL_RETRY_POLICIES": str(policy_file)}
    mock_provider.configure(fault_408_ratio=1.0)
    processes.worker("sms", "transactional")
    processes.retrier("sms", "transactional")
    processes.start("outcome-recorder", "outcome-recorder", ready="outcome recorder consuming")
    store = StatusStore(redis_client, namespace)

    send_id = send_client.publish("acme", {**sms_request(), "template_id": "receipt"})
    wait_until(lambda: (store.get(send_id) or {}).get("status") == "retrying", 30, "the send to be retrying")

    records = wait_until(lambda: read_all(stack.bootstrap, names.dlq, timeout_s=5), 60,
                         "the send to be dead-lettered")
    assert len(records) == 1
    r = records[0]
    assert r.key == send_id and r.headers["send_id"] == send_id
    assert r.reason == "retries_exhausted" and r.headers["attempts"] == "3"
    assert r.headers["tenant"] == "acme" and r.headers["channel"] == "sms"
    assert r.headers["last_error"].startswith("408 request_timeout")
    assert mock_provider.stats()["faults_408"] == 3  # exactly the policy's attempts
    status = wait_until(lambda: (s := store.get(send_id)) and s["status"] == "dead_lettered" and s, 30,
                        "the dead-lettered status")
    assert [(a["n"], a["status_code"], a["outcome"]) for a in status["attempt_history"]] == [
        (1, 408, "unavailable"), (2, 408, "unavailable"), (3, 408, "unavailable")]
    assert all(a["duration_ms"] >= 0 and a["at_ms"] > 0 for a in status["attempt_history"])

    # When the provider recovers and an operator replays the dead letter
    mock_provider.configure(fault_408_ratio=0.0)
    out = _cli(env, "dlq", "replay", send_id)
    assert out.returncode == 0, out.stderr
    replay_id = out.stdout.split(" as a new send ")[1].split()[0]
    assert replay_id != send_id
    wait_until(lambda: replay_id in mock_provider.stats(deliveries=True)["deliveries"], 30,
               "the replayed send to be delivered")
    stats = mock_provider.stats(deliveries=True)
    assert send_id not in stats["deliveries"] and stats["duplicate_deliveries"] == 0
    replayed = wait_until(lambda: (s := store.get(replay_id)) and s["status"] == "delivered" and s, 30,
                          "the replay's status")
    assert replayed["replay_of"] == send_id

    # A delivered send can be replayed too: again a new delivery
    again = _cli(env, "sends", "replay", replay_id)
    assert again.returncode == 0, again.stderr
    second_id = again.stdout.split(" as a new send ")[1].split()[0]
    wait_until(lambda: second_id in mock_provider.stats(deliveries=True)["deliveries"], 30, "the second replay")
    replays = [e for e in AuditLog(stack.bootstrap, names.audit).read() if e["what"].startswith("replay/")]
    assert [(e["what"], e["after"]["send_id"], e["who"]) for e in replays] == [
        (f"replay/{send_id}", replay_id, cli_actor()), (f"replay/{replay_id}", second_id, cli_actor())]

    shown = _cli(env, "dlq", "show", send_id)
    assert "retries_exhausted" in shown.stdout and "+14155550123" not in shown.stdout
    missing = _cli(env, "dlq", "replay", "no-such-send")
    assert missing.returncode == 1 and "no send no-such-send" in missing.stderr
    eight_days_later = int(time.time() * 1000) + 8 * 24 * 3600 * 1000
    with pytest.raises(ReplayRefused, match="has expired: payloads are kept 7 days"):
        replay(stack.bootstrap, names, store, send_client, send_id, now_ms=eight_days_later)

    # A lane that no longer takes records this large: refused for good (a bulk replay keeps it out), not a 503
    lane = names.lane("sms", "transactional")
    admin = AdminClient({"bootstrap.servers": stack.bootstrap})
    change = ConfigResource(ConfigResource.Type.TOPIC, lane, incremental_configs=[
        ConfigEntry("max.message.bytes", "100", incremental_operation=AlterConfigOpType.SET)])
    for f in admin.incremental_alter_configs([change]).values():
        f.result()

    def lane_limit() -> str:  # the change is applied from the metadata log: described once the broker has it
        [described] = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, lane)]).values()
        return described.result()["max.message.bytes"].value

    wait_until(lambda: lane_limit() == "100", 10, "the broker to apply the lane's new max.message.bytes")
    fresh = SendClient(stack.bootstrap, names)  # reads the topic's limit anew
    try:
        with pytest.raises(ReplayRefused, match=f"send {send_id} cannot be replayed: record 0 is"):
            replay(stack.bootstrap, names, store, fresh, send_id)
    finally:
        fresh.close()


def test_a_record_the_broker_does_not_give_in_time_is_not_taken_as_gone(stack, create_topics, names):
    """Given a record at a known position of a topic,
    When it is read with the normal timeout, read with no time to read it, and read past the topic's end,
    Then the first gives the record, the second raises BrokerUnavailable (before: "absent", so a replay
    called its payload expired and a bulk replay gave it up for good), and only the third says absent."""
    topic = f"{names.dlq}.fetch-check"
    create_topics({topic: 1})
    producer = durable_producer(stack.bootstrap)
    put_acked(producer, topic, b"send-1", b"payload", 10, "a test record")
    assert fetch(stack.bootstrap, topic, 0, 0).value() == b"payload"
    with pytest.raises(BrokerUnavailable, match="did not give the record at offset 0"):
        fetch(stack.bootstrap, topic, 0, 0, timeout_s=0)
    assert fetch(stack.bootstrap, topic, 0, 1) is None


def test_a_record_deleted_by_retention_while_it_is_fetched_is_gone_not_a_broker_outage(
        stack, create_topics, names, monkeypatch):
    """Given three records of which retention deletes the first two just after their watermarks were read (the
    watermarks still say offset 0 is there),
    When the record at offset 0 is fetched,
    Then it is gone (None, which a replay reports as an expired payload) at once (before: the fetch, out of range,
    jumped to the topic's end, waited out its 10 s and raised BrokerUnavailable: a broker outage that was not)."""
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient

    from streams.retry import dlq

    topic = f"{names.dlq}.retention-check"
    create_topics({topic: 1})
    producer = durable_producer(stack.bootstrap)
    for n in range(3):
        put_acked(producer, topic, f"send-{n}".encode(), b"payload", 10, "a test record")
    admin = AdminClient({"bootstrap.servers": stack.bootstrap})  # kept: its futures complete through it
    [deleted] = admin.delete_records([TopicPartition(topic, 0, 2)]).values()
    assert deleted.result(timeout=30).low_watermark == 2
    monkeypatch.setattr(dlq, "watermarks", lambda consumer, tp: (0, 3))  # as read just before the deletion
    assert fetch(stack.bootstrap, topic, 0, 0, timeout_s=10) is None


def test_a_replay_grown_past_the_send_limit_is_refused_for_good(stack, names, channel_topics, send_client,
                                                                 redis_client, namespace):
    """Given a delivered email send 20 bytes under the send limit (its lane record is the replay's payload),
    When it is replayed (the replay carries `replay_of`: 34 bytes more),
    Then the replay is refused for good, saying why (ReplayRefused: 409 from the API, and a bulk replay lists it
    as refused), not a PublishError that every later bulk replay of the endpoint would stop at."""
    channel_topics("email")
    small = build_send(validate_request(email_request(html="x")), "shop")
    html = "x" * (1 + MAX_SEND_BYTES - 20 - len(encode(small)))
    send = build_send(validate_request(email_request(html=html)), "shop")
    assert len(encode(send)) == MAX_SEND_BYTES - 20
    [written] = send_client.publish_sends([send])
    store = StatusStore(redis_client, namespace)
    store.record_outcome({"send_id": send.send_id, "status": "delivered", "tenant_id": "shop",
                          "completed_at_ms": int(time.time() * 1000),
                          "origin": {"topic": written.topic, "partition": written.partition,
                                     "offset": written.offset}})
    with pytest.raises(ReplayRefused, match=f"send {send.send_id} cannot be replayed: send 0 is"):
        replay(stack.bootstrap, names, store, send_client, send.send_id)



def test_a_replay_whose_kept_record_is_now_another_tenants_send_is_refused(stack, names, channel_topics, send_client,
                                                                         redis_client, namespace):
    """Given shop's delivered send whose status names the lane position where its payload is kept, and that
    position now holding another tenant's send (a topic deleted and created again reuses offsets),
    When shop replays its send,
    Then the replay is refused, saying the record is another send's, and nothing is published (before, the other
    tenant's message was sent again, as shop's replay)."""
    channel_topics("email")
    other = build_send(validate_request(email_request(subject="Private to acme")), "acme")
    [written] = send_client.publish_sends([other])
    store = StatusStore(redis_client, namespace)
    shops = build_send(validate_request(email_request()), "shop")
    store.record_outcome({"send_id": shops.send_id, "status": "delivered", "tenant_id": "shop",
                          "completed_at_ms": int(time.time() * 1000),
                          "origin": {"topic": written.topic, "partition": written.partition,
                                     "offset": written.offset}})
    before = count_records(stack.bootstrap, written.topic)
    with pytest.raises(ReplayRefused, match="the record where its payload was kept is now another send's"):
        replay(stack.bootstrap, names, store, send_client, shops.send_id, tenant="shop")
    assert count_records(stack.bootstrap, written.topic) == before

def _dead_letter(send_client, store, reason: str, status: str = "dead_lettered") -> str:
    """A published email send recorded as `status` (its lane record is where a replay finds its payload)."""
    send = build_send(validate_request(email_request()), "shop")
    [written] = send_client.publish_sends([send])
    store.record_outcome({"send_id": send.send_id, "status": status, "tenant_id": "shop", "reason": reason,
                          "completed_at_ms": int(time.time() * 1000),
                          "origin": {"topic": written.topic, "partition": written.partition,
                                     "offset": written.offset}})
    return send.send_id


def test_a_dead_letter_is_replayed_once_and_a_risky_or_delivered_one_is_refused(
        stack, names, channel_topics, send_client, redis_client, namespace):
    """Given dead letters on the real stack: one `retries_exhausted`, one `unknown_outcome` (the provider may
    hold it), and a send that was delivered,
    When each is replayed as a dead letter (`streams dlq replay`, POST /v1/admin/dlq/{id}/replay), the first twice,
    Then the first is published once, and the second call answers the first call's send id; the unknown_outcome
    one is refused, saying why and how, until the operator says they checked the provider; the delivered one is
    refused (it is no dead letter)."""
    channel_topics("email")
    store = StatusStore(redis_client, namespace)
    lane = names.lane("email", "transactional")
    exhausted = _dead_letter(send_client, store, "retries_exhausted")
    unknown = _dead_letter(send_client, store, "unknown_outcome")
    delivered = _dead_letter(send_client, store, "", status="delivered")
    assert count_records(stack.bootstrap, lane) == 3

    first = replay_dead_letter(stack.bootstrap, names, store, send_client, exhausted)
    second = replay_dead_letter(stack.bootstrap, names, store, send_client, exhausted)
    assert first.send is not None and first.send.replay_of == exhausted
    assert second.send is None and second.send_id == first.send_id
    assert count_records(stack.bootstrap, lane) == 4  # one replay published

    with pytest.raises(ReplayRefused, match="unknown_outcome after an attempt whose outcome is unknown: the provider "
                                            "may have accepted it.*--outcome-checked"):
        replay_dead_letter(stack.bootstrap, names, store, send_client, unknown)
    with pytest.raises(ReplayRefused, match="unknown_outcome"):  # nor as a send
        replay(stack.bootstrap, names, store, send_client, unknown)
    with pytest.raises(ReplayRefused, match=f"send {delivered} was delivered: it is not a dead letter"):
        replay_dead_letter(stack.bootstrap, names, store, send_client, delivered)
    assert count_records(stack.bootstrap, lane) == 4  # the refusals published nothing, and claimed nothing
    checked = replay_dead_letter(stack.bootstrap, names, store, send_client, unknown, outcome_checked=True)
    assert checked.send is not None and checked.send.replay_of == unknown
    assert count_records(stack.bootstrap, lane) == 5


def test_a_checked_dead_letter_waits_for_the_batch_request_that_may_still_send_it(
        stack, names, channel_topics, send_client, redis_client, namespace):
    """Given two emails sent in one batch request whose outcome is unknown (kept claimed, its body kept to be sent
    again whole under its key), the first dead-lettered `unknown_outcome` and the second still retrying, and a
    third dead letter whose request has since been sent again and delivered (its status not yet updated), and a
    fourth whose request another worker is sending again right now,
    When an operator who checked the provider replays the first, the third and the fourth,
    Then the first is refused for now, saying that its batch request may still send it and to replay once the other
    sends are settled, with nothing published (before: it was replayed, and the second's retry re-sent the whole
    batch: delivered twice) and naming the send to wait for; once the second is dead-lettered too, the same replay
    goes; the third is refused (delivered), the fourth refused for now (its re-send may yet deliver it)."""
    channel_topics("email")
    store, jobs = StatusStore(redis_client, namespace), ProcessedJobs(redis_client, namespace)
    lane = names.lane("email", "transactional")
    first, third, fourth = (_dead_letter(send_client, store, "unknown_outcome") for _ in range(3))
    second = build_send(validate_request(email_request()), "shop").send_id
    store.record_outcome({"send_id": second, "status": "retrying", "tenant_id": "shop", "attempts": 1})
    batch = Claim("shop", idempotency_key([first, second]), (first, second), "w-1", "/emails/batch", b"[]")
    resend = Claim("shop", idempotency_key([fourth]), (fourth,), "w-2", "/emails", b"{}")  # another worker's
    assert jobs.claim_many([batch, Claim("shop", "send-x", (third,), "w-1", "/emails", b"{}"), resend]) == [[]] * 3
    jobs.keep_unknown("shop", batch.key, "w-1", batch.send_ids)
    jobs.mark_delivered("shop", [third], "send-x")

    waiting_for = f"batch request whose outcome is unknown.*unsettled sends \\({second}\\)"
    with pytest.raises(ReplayNotYet, match=waiting_for):
        replay_dead_letter(stack.bootstrap, names, store, send_client, first, outcome_checked=True)
    with pytest.raises(ReplayNotYet, match=f"send {fourth} is being sent again by dispatch right now"):
        replay_dead_letter(stack.bootstrap, names, store, send_client, fourth, outcome_checked=True)
    with pytest.raises(ReplayRefused, match=f"send {third} has been delivered since it was dead_lettered"):
        replay_dead_letter(stack.bootstrap, names, store, send_client, third, outcome_checked=True)
    assert count_records(stack.bootstrap, lane) == 3  # nothing published
    store.record_outcome({"send_id": second, "status": "dead_lettered", "tenant_id": "shop",
                          "reason": "unknown_outcome", "attempts": 2})
    done = replay_dead_letter(stack.bootstrap, names, store, send_client, first, outcome_checked=True)
    assert done.send is not None and done.send.replay_of == first
    assert count_records(stack.bootstrap, lane) == 4


class InterruptedClient:
    """The operator's Ctrl-C lands while the replay's publish waits for the broker's acknowledgement."""

    def __init__(self, client: SendClient):
        self.client = client

    def publish_sends(self, sends):
        raise KeyboardInterrupt

    def __getattr__(self, name):
        return getattr(self.client, name)


def test_a_dead_letter_replay_interrupted_while_publishing_keeps_its_claim(
        stack, names, channel_topics, send_client, redis_client, namespace):
    """Given a dead letter whose replay is interrupted (Ctrl-C) while its publish waits for the broker,
    When the operator runs `streams dlq replay` again,
    Then the first call ends saying the replay may have been published, naming its send id to look up, and the
    second is refused (the claim was kept, so no second replay with another send id); before, the interrupt
    freed the claim, and the second call published a second replay."""
    channel_topics("email")
    store = StatusStore(redis_client, namespace)
    exhausted = _dead_letter(send_client, store, "retries_exhausted")

    with pytest.raises(ReplayOutcomeUnknown, match="may have been published as .*KeyboardInterrupt") as unknown:
        replay_dead_letter(stack.bootstrap, names, store, InterruptedClient(send_client), exhausted)

    assert unknown.value.replay_id and store.get(exhausted)["replayed_as"] == "pending"
    with pytest.raises(ReplayRefused, match="left unconfirmed"):
        replay_dead_letter(stack.bootstrap, names, store, send_client, exhausted)
    assert count_records(stack.bootstrap, names.lane("email", "transactional")) == 1  # the dead letter's own


def test_a_replay_redis_could_not_record_is_named_once_its_accepted_event_is_recorded(
        stack, names, channel_topics, send_client, redis_client, namespace, monkeypatch):
    """Given a dead letter whose replay is published, and Redis fails just as the replay is to be recorded on it
    (its claim stays `pending`, so it is never replayed twice),
    When the outcome recorder records the replay's `accepted` event, and an operator asks for the replay again,
    Then the answer is the replay's send id (`earlier`), nothing more is published (before: refused as "left
    unconfirmed" for as long as the status lived); another tenant's event naming the send as its `replay_of`
    never marks it."""
    channel_topics("email")
    store = StatusStore(redis_client, namespace)
    exhausted = _dead_letter(send_client, store, "retries_exhausted")

    def failing(*_):
        raise StoreUnavailable("recording a replay: Redis is unavailable")

    monkeypatch.setattr(StatusStore, "mark_replayed", failing)
    first = replay_dead_letter(stack.bootstrap, names, store, send_client, exhausted)
    monkeypatch.undo()
    assert first.send is not None and store.get(exhausted)["replayed_as"] == "pending"

    events = [e for m in committed_messages(stack.bootstrap, names.outcomes) for e in events_of(orjson.loads(m.value()))]
    [accepted] = [e for e in events if e["send_id"] == first.send_id]
    store.record_outcome({**accepted, "send_id": "forged", "tenant_id": "other"})
    assert store.get(exhausted)["replayed_as"] == "pending"
    store.record_outcome(accepted)
    assert store.get(exhausted)["replayed_as"] == first.send_id

    again = replay_dead_letter(stack.bootstrap, names, store, send_client, exhausted)
    assert again.send is None and again.send_id == first.send_id
    assert count_records(stack.bootstrap, names.lane("email", "transactional")) == 2  # the dead letter and one replay


def test_a_dead_letter_replayed_deliberately_is_not_replayed_again_as_a_dead_letter(
        stack, names, channel_topics, send_client, redis_client, namespace, dispatch_env):
    """Given a dead letter an operator replays deliberately (`streams sends replay`), and another whose deliberate
    replay is interrupted (Ctrl-C) while the broker may be writing it,
    When a colleague then replays each as a dead letter (`streams dlq replay`),
    Then the first is answered with the deliberate replay's send id, and the second is refused as left unconfirmed
    (it may be out: `streams sends replay` sends it again once it is known not to be), both publishing nothing
    (before, both published the send once more: a second delivery); and a bulk or dead-letter replay's claim freed
    after a failed publish keeps a deliberate replay's mark written over it meanwhile."""
    channel_topics("email")
    store = StatusStore(redis_client, namespace)
    lane = names.lane("email", "transactional")
    replayed = _dead_letter(send_client, store, "retries_exhausted")
    interrupted = _dead_letter(send_client, store, "retries_exhausted")

    deliberate = _cli(dispatch_env, "sends", "replay", replayed)
    assert deliberate.returncode == 0, deliberate.stderr
    deliberate_id = deliberate.stdout.split(" as a new send ")[1].split()[0]
    with pytest.raises(ReplayOutcomeUnknown) as unknown:
        replay(stack.bootstrap, names, store, InterruptedClient(send_client), interrupted, alone=True)
    assert count_records(stack.bootstrap, lane) == 3

    again = _cli(dispatch_env, "dlq", "replay", replayed)
    assert again.returncode == 0, again.stderr
    assert f"{replayed} was replayed already as {deliberate_id}" in again.stdout
    assert unknown.value.replay_id and store.get(interrupted)["replayed_as"] == "pending"
    with pytest.raises(ReplayRefused, match="left unconfirmed"):
        replay_dead_letter(stack.bootstrap, names, store, send_client, interrupted)
    assert count_records(stack.bootstrap, lane) == 3  # nothing more published

    raced = _dead_letter(send_client, store, "retries_exhausted")
    assert store.claim_replay(raced)  # a bulk replay's claim, its publish under way
    store.mark_replayed_alone(raced, "the-deliberate-replay", "shop")  # a deliberate replay meanwhile
    store.release_replay(raced)  # the claim's publish failed: nothing of its own to keep
    assert store.get(raced)["replayed_as"] == "the-deliberate-replay"
