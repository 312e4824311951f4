"""`streams state recover` on a real broker and Redis: it reads notif.outcomes to its end and rebuilds the
delivered marks, whatever else the topic holds."""

import logging
import re
import time
import uuid

import orjson
import pytest
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient

import streams.state.recover as recover_module
from streams.errors import StackError, StateLost
from streams.gate.limits import LimitStore
from streams.ingest.api_keys import ApiKeys
from streams.ingest.status import StatusStore
from streams.kafka_client import put_acked
from streams.names import RedisKeys
from streams.retry.replay import replay_dead_letter
from streams.send import build_send, validate_request
from streams.state.guard import StateGuard, log_epoch
from streams.state.log import OperatorLog
from streams.state.recover import acknowledge_loss, recover
from tests.harness import count_records, email_request


def _delivered(send_id: str, now_ms: int) -> dict:
    return {"send_id": send_id, "tenant_id": "acme", "channel": "email", "lane": "transactional",
            "status": "delivered", "attempts": 1, "provider": "resend", "provider_message_id": "m1", "reason": "",
            "created_at_ms": now_ms - 1000, "completed_at_ms": now_ms}


def test_recover_finishes_when_a_transaction_marker_ends_the_outcomes_partition(
        stack, channel_topics, oplog_topic, names, namespace, redis_client):
    """Given notif.outcomes whose one partition ends with a transaction of two outcome records (as ingest writes
    a request's skipped deliveries), so its last offset is the commit marker no consumer is ever given,
    When `streams state recover` runs,
    Then it finishes, rebuilds both sends' delivered marks and statuses, and writes the epoch back."""
    channel_topics("email")
    now_ms = int(time.time() * 1000)
    producer = Producer({"bootstrap.servers": stack.bootstrap, "transactional.id": f"test-{uuid.uuid4().hex}"})
    producer.init_transactions(10)
    producer.begin_transaction()
    for send_id in ("s-1", "s-2"):
        producer.produce(names.outcomes, orjson.dumps(_delivered(send_id, now_ms)), key=b"k", partition=0)
    producer.commit_transaction(10)
    keys = RedisKeys(namespace)
    oplog = OperatorLog(stack.bootstrap, oplog_topic)

    result = recover(stack.bootstrap, redis_client, names, keys, oplog)

    assert (result.events, result.delivered_marks, result.skipped) == (2, 2, 0)
    assert [redis_client.get(keys.processed("acme", s)) for s in ("s-1", "s-2")] == [b"delivered", b"delivered"]
    store = StatusStore(redis_client, namespace)
    assert [store.get(s)["status"] for s in ("s-1", "s-2")] == ["delivered", "delivered"]
    assert redis_client.get(keys.epoch).decode() == log_epoch(oplog.snapshot())


def test_recover_reads_from_the_start_retention_moved_to_while_it_began(
        stack, channel_topics, oplog_topic, names, namespace, redis_client, monkeypatch):
    """Given notif.outcomes whose partition holds six delivered events, of which retention deleted the first two
    after recovery read the partition's start (its low watermark still said 0),
    When `streams state recover` reads from that start, which no longer exists,
    Then it reads on from the partition's new start: the four events still there get their delivered marks back
    (before: the consumer jumped to the partition's end, as librdkafka does by default, and recovery failed
    after 30 s as stalled, with none rebuilt)."""
    channel_topics("email")
    now_ms = int(time.time() * 1000)
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    sends = [f"s-{i}" for i in range(6)]
    for send_id in sends:
        producer.produce(names.outcomes, orjson.dumps(_delivered(send_id, now_ms)), key=b"k", partition=0)
    assert producer.flush(10) == 0
    admin = AdminClient({"bootstrap.servers": stack.bootstrap})  # kept: its futures need it alive
    for future in admin.delete_records([TopicPartition(names.outcomes, 0, 2)]).values():
        future.result(10)
    read = recover_module.watermarks
    monkeypatch.setattr(recover_module, "watermarks", lambda c, tp: (0, read(c, tp)[1]))  # read before retention
    keys = RedisKeys(namespace)

    result = recover(stack.bootstrap, redis_client, names, keys, OperatorLog(stack.bootstrap, oplog_topic))

    assert result.delivered_marks == 4
    assert [redis_client.get(keys.processed("acme", s)) for s in sends] == [None, None] + [b"delivered"] * 4


def test_recover_rebuilds_the_marks_that_keep_a_copy_read_again_from_being_sent(
        stack, channel_topics, oplog_topic, names, namespace, redis_client):
    """Given notif.outcomes holding, for sends of the last week: one dead-lettered `unknown_outcome` (the provider may
    hold it); one whose attempt 3 failed (`retrying`: only its copy for attempt 3 is known to have been read, the
    one for attempt 4 may never have been written); one whose attempt 1 failed and whose attempt 2 was then
    delivered; a webhook delivery dropped after 9 attempts; a delivery a worker skipped before its third attempt;
    one whose `unknown` attempt 1 left its request claimed on a shard that kept its data; one kept claimed by a
    request after its attempt 1 (the request's body, to re-send under its key, lost with the data); and one
    dead-lettered `too_old` before its attempt 3,
    When `streams state recover` runs after Redis lost its data,
    Then the marks are back as far as the events prove them: `reconcile`, `tried:2`, `delivered`, `tried:9`,
    `tried:3`, the claim left as it was, `reconcile` (never re-sent under another key) and `tried:3` (that copy,
    released again, is not dead-lettered twice); so a copy read again (a rebalance, the retrier releasing copies
    again after a restart) is neither sent a second time nor starts a second chain, and the live copy still goes
    (before: only `delivered` was rebuilt)."""
    channel_topics("email")
    now_ms = int(time.time() * 1000)

    def event(send_id: str, status: str, attempts: int, reason: str = "", **more) -> bytes:
        return orjson.dumps({**_delivered(send_id, now_ms), "status": status, "attempts": attempts, "reason": reason,
                             **more})

    producer = Producer({"bootstrap.servers": stack.bootstrap})
    origin = {"topic": names.lane("webhook", "transactional"), "partition": 0, "offset": 7}
    for value in (event("s-unknown", "dead_lettered", 3, "unknown_outcome"), event("s-retrying", "retrying", 3),
                  event("s-later", "retrying", 1), event("s-later", "delivered", 2),
                  event("s-dropped", "dropped", 9, "retries_exhausted"),
                  event("s-skipped", "skipped", 2, origin=origin), event("s-claimed", "unknown", 2),
                  event("s-kept", "retrying", 1, kept=True), event("s-old", "dead_lettered", 2, "too_old")):
        producer.produce(names.outcomes, value, key=b"k", partition=0)
    assert producer.flush(10) == 0
    keys = RedisKeys(namespace)
    redis_client.set(keys.processed("acme", "s-claimed"), "inflight:batch-x")

    result = recover(stack.bootstrap, redis_client, names, keys, OperatorLog(stack.bootstrap, oplog_topic))

    marks = [redis_client.get(keys.processed("acme", s))
             for s in ("s-unknown", "s-retrying", "s-later", "s-dropped", "s-skipped", "s-claimed", "s-kept", "s-old")]
    assert marks == [b"reconcile", b"tried:2", b"delivered", b"tried:9", b"tried:3", b"inflight:batch-x", b"reconcile",
                     b"tried:3"]
    assert (result.delivered_marks, result.stop_marks) == (1, 6)


def test_recover_does_not_end_the_hold_when_redis_loses_its_data_again_meanwhile(
        stack, channel_topics, oplog_topic, names, namespace, redis_client, monkeypatch):
    """Given notif.outcomes holding two delivered events,
    When Redis loses its data again while `streams state recover` applies the first (restarted empty: every key of
    this deployment gone),
    Then recovery fails saying so and to run it again, and the epoch is not written: dispatch keeps holding (before:
    the epoch was written over a store missing the marks rebuilt before the second loss, and the hold ended); run
    again, it rebuilds both marks and writes the epoch."""
    channel_topics("email")
    now_ms = int(time.time() * 1000)
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    for send_id in ("s-1", "s-2"):
        producer.produce(names.outcomes, orjson.dumps(_delivered(send_id, now_ms)), key=b"k", partition=0)
    assert producer.flush(10) == 0
    keys, oplog = RedisKeys(namespace), OperatorLog(stack.bootstrap, oplog_topic)
    record, lost = StatusStore.record_outcome, []

    def losing_data_once(store, event, **how):
        record(store, event, **how)
        if not lost:
            lost.append(redis_client.delete(*redis_client.keys(f"{namespace}*")))

    monkeypatch.setattr(StatusStore, "record_outcome", losing_data_once)
    with pytest.raises(StackError, match="Redis lost its data again while recovery ran.*run `streams state recover`"):
        recover(stack.bootstrap, redis_client, names, keys, oplog)
    assert lost and redis_client.get(keys.epoch) is None

    monkeypatch.setattr(StatusStore, "record_outcome", record)
    recover(stack.bootstrap, redis_client, names, keys, oplog)
    assert [redis_client.get(keys.processed("acme", s)) for s in ("s-1", "s-2")] == [b"delivered", b"delivered"]
    assert redis_client.get(keys.epoch).decode() == log_epoch(oplog.snapshot())
    assert redis_client.keys(f"{namespace}dr:recovering*") == []


def _one_delivered_event(stack, names, namespace, oplog_topic):
    """notif.outcomes holding one delivered event (of send s-1); the keys and operator log a recovery runs with."""
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    producer.produce(names.outcomes, orjson.dumps(_delivered("s-1", int(time.time() * 1000))), key=b"k", partition=0)
    assert producer.flush(10) == 0
    return RedisKeys(namespace), OperatorLog(stack.bootstrap, oplog_topic)


def test_two_recover_runs_at_once_both_end_without_a_false_alarm(
        stack, channel_topics, oplog_topic, names, namespace, redis_client, monkeypatch):
    """Given notif.outcomes holding a delivered event,
    When a second `streams state recover` runs (another operator) and ends while the first is applying it,
    Then the first ends too, with the mark rebuilt and the epoch written (before: the second run removed the
    markers the first had written, and the first reported that Redis had lost its data again)."""
    channel_topics("email")
    keys, oplog = _one_delivered_event(stack, names, namespace, oplog_topic)
    record, runs = StatusStore.record_outcome, []

    def a_second_run_alongside(store, event, **how):
        record(store, event, **how)
        if not runs:
            runs.append("second")
            runs.append(recover(stack.bootstrap, redis_client, names, keys, oplog))

    monkeypatch.setattr(StatusStore, "record_outcome", a_second_run_alongside)
    first = recover(stack.bootstrap, redis_client, names, keys, oplog)
    assert first.delivered_marks == runs[1].delivered_marks == 1
    assert redis_client.get(keys.processed("acme", "s-1")) == b"delivered"
    assert redis_client.get(keys.epoch).decode() == log_epoch(oplog.snapshot())
    assert redis_client.keys(f"{namespace}dr:recovering*") == []


def test_recover_rebuilds_the_mark_of_an_event_with_a_bad_optional_field_and_says_what_it_skipped(
        stack, channel_topics, oplog_topic, names, namespace, redis_client, caplog):
    """Given notif.outcomes holding a record that is not JSON, a delivered event whose provider_message_id
    is a number (its send id, tenant and status good), and a good delivered event,
    When `streams state recover` runs,
    Then both delivered marks are rebuilt (the send with the bad field is not sent again), the bad event's
    status is not recorded, and each skip is counted and logged with the field or why and its offset."""
    channel_topics("email")
    now_ms = int(time.time() * 1000)
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    for value in (b"{not json", orjson.dumps({**_delivered("s-bad", now_ms), "provider_message_id": 42}),
                  orjson.dumps(_delivered("s-good", now_ms))):
        put_acked(producer, names.outcomes, b"k", value, 10, "an outcome record")
    keys = RedisKeys(namespace)

    with caplog.at_level(logging.INFO):
        result = recover(stack.bootstrap, redis_client, names, keys, OperatorLog(stack.bootstrap, oplog_topic))

    assert [redis_client.get(keys.processed("acme", s)) for s in ("s-bad", "s-good")] == [b"delivered"] * 2
    assert (result.delivered_marks, result.statuses, result.skipped) == (2, 1, 2)
    store = StatusStore(redis_client, namespace)
    assert store.get("s-bad") is None and store.get("s-good")["status"] == "delivered"
    skips = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skips) == 2, skips
    at = re.escape(names.outcomes) + r"\[\d+\]@"
    assert any("not JSON" in s and re.search(at + "0:", s) for s in skips), skips
    assert any("'provider_message_id'" in s and re.search(at + "1:", s) for s in skips), skips


def test_a_dead_letter_replayed_before_the_loss_is_not_replayed_again_during_or_after_recover(
        stack, channel_topics, oplog_topic, names, namespace, redis_client, send_client, monkeypatch):
    """Given an email send dead-lettered (its outcome on notif.outcomes, as a worker writes it) and replayed once
    (`streams dlq replay`: a new send, not yet dispatched),
    When Redis loses this deployment's data, `streams state recover` runs, and the dead letter is replayed again
    (an operator, or a client retrying after the outage's 503),
    Then the second call answers the first replay's send id and publishes nothing: the replay's `accepted` event,
    published right after the replay, tells recover that the send was replayed. Before, recover rebuilt the
    dead letter's status without that mark, and the second call published a second replay (sent twice).
    And a replay asked while recover runs, after it rebuilt the dead letter's status and before the replay marks,
    is refused (the state guard says Redis lost its data) and publishes nothing (before: published, sent twice)."""
    channel_topics("email")
    guard = StateGuard(redis_client, RedisKeys(namespace), OperatorLog(stack.bootstrap, oplog_topic), "api")
    assert guard.check()  # the deployment's epoch, in Redis and the operator log
    store = StatusStore(redis_client, namespace, holds_data=guard.check)  # as the API's
    send = build_send(validate_request(email_request()), "shop")
    [written] = send_client.publish_sends([send])
    dead = {"send_id": send.send_id, "status": "dead_lettered", "tenant_id": "shop", "channel": "email",
            "lane": "transactional", "reason": "retries_exhausted", "completed_at_ms": int(time.time() * 1000),
            "origin": {"topic": written.topic, "partition": written.partition, "offset": written.offset}}
    put_acked(send_client.producer, names.outcomes, send.send_id.encode(), orjson.dumps(dead), 10, "a dead letter")
    store.record_outcome(dead)  # what the outcome recorder does
    first = replay_dead_letter(stack.bootstrap, names, store, send_client, send.send_id)
    assert first.send is not None
    lane = names.lane("email", "transactional")
    assert count_records(stack.bootstrap, lane) == 2

    lost = list(redis_client.scan_iter(f"{namespace}*"))
    assert lost and redis_client.delete(*lost) == len(lost)
    restore_replays = StatusStore.restore_replays

    def replayed_meanwhile(recovering: StatusStore, replays):
        assert store.get(send.send_id)["status"] == "dead_lettered"  # rebuilt; its replay mark not yet
        guard.recheck()  # the guard looks at most every 5 s: recover runs long after the loss, and it has looked
        with pytest.raises(StateLost):
            replay_dead_letter(stack.bootstrap, names, store, send_client, send.send_id)
        return restore_replays(recovering, replays)

    monkeypatch.setattr(StatusStore, "restore_replays", replayed_meanwhile)
    result = recover(stack.bootstrap, redis_client, names, RedisKeys(namespace), OperatorLog(stack.bootstrap,
                                                                                            oplog_topic))
    assert (result.statuses, result.replay_marks) == (2, 1)
    assert count_records(stack.bootstrap, lane) == 2

    guard.recheck()  # its next look finds the epoch recover wrote
    again = replay_dead_letter(stack.bootstrap, names, store, send_client, send.send_id)
    assert (again.send, again.send_id) == (None, first.send_id)
    assert count_records(stack.bootstrap, lane) == 2


def test_a_recover_run_that_stops_half_way_leaves_no_markers_behind(
        stack, channel_topics, oplog_topic, names, namespace, redis_client, monkeypatch):
    """Given notif.outcomes holding a delivered event,
    When `streams state recover` is interrupted while applying it (Ctrl-C),
    Then it ends without writing the epoch and without leaving its markers behind (each run has its own: on a Redis
    Cluster 16,385 keys a run, which every interrupted run would otherwise add for 7 days)."""
    channel_topics("email")
    keys, oplog = _one_delivered_event(stack, names, namespace, oplog_topic)

    def interrupted(store, event, **how):
        raise KeyboardInterrupt

    monkeypatch.setattr(StatusStore, "record_outcome", interrupted)
    with pytest.raises(KeyboardInterrupt):
        recover(stack.bootstrap, redis_client, names, keys, oplog)
    assert redis_client.get(keys.epoch) is None
    assert redis_client.keys(f"{namespace}dr:recovering*") == []


def test_recover_keeps_each_status_30_days_from_its_sends_last_event_not_from_the_recovery(
        stack, channel_topics, oplog_topic, names, namespace, redis_client):
    """Given notif.outcomes holding a send delivered 29 days ago (with its attempt), one delivered now, and one
    delivered 31 days ago (its segment not deleted yet),
    When `streams state recover` runs after Redis lost its data,
    Then the first's status and attempts are kept about one more day, the second's 30 days, and the third's are not
    rebuilt, their `accepted` events read after them changing none of that (before: an accepted event, taken as
    happening at the recovery, set 30 more days, and brought the third back as `accepted`; before that: every rebuilt status was kept 30 days from the recovery, so for a month Redis, sized for 30 days
    of statuses, held up to twice as many, and GET /v1/sends showed sends older than its documented 30 days)."""
    channel_topics("email")
    now_ms = int(time.time() * 1000)
    day_ms = 24 * 3600 * 1000
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    for send_id, completed in (("s-29d", now_ms - 29 * day_ms), ("s-now", now_ms), ("s-31d", now_ms - 31 * day_ms)):
        event = {**_delivered(send_id, completed), "attempt": {"n": 1, "outcome": "delivered"}}
        producer.produce(names.outcomes, orjson.dumps(event), key=send_id.encode(), partition=0)
        # Its `accepted` event, 12 hours older, read after it (a batch's is keyed by its first send: read in any order)
        accepted = {k: v for k, v in event.items() if k in ("send_id", "tenant_id", "channel", "lane")}
        accepted.update(status="accepted", created_at_ms=completed - day_ms // 2, accepted_at_ms=completed - day_ms // 2)
        producer.produce(names.outcomes, orjson.dumps(accepted), key=send_id.encode(), partition=0)
    assert producer.flush(10) == 0
    keys = RedisKeys(namespace)

    recover(stack.bootstrap, redis_client, names, keys, OperatorLog(stack.bootstrap, oplog_topic))

    def days_left(key: str) -> float:
        return redis_client.ttl(key) / 86400

    assert 0.9 < days_left(keys.send_status("s-29d")) <= 1.0 and 0.9 < days_left(keys.send_attempts("s-29d")) <= 1.0
    assert 29.9 < days_left(keys.send_status("s-now")) <= 30.0
    assert not redis_client.exists(keys.send_status("s-31d"))  # nor brought back `accepted` by its accepted event
    assert redis_client.hget(keys.send_status("s-29d"), "status") == b"delivered"


@pytest.mark.parametrize("ends_the_hold", ["recover", "acknowledge_loss"])
def test_the_operator_state_comes_back_when_no_role_ran_while_redis_lost_its_data(
        stack, channel_topics, oplog_topic, names, namespace, redis_client, ends_the_hold):
    """Given a deployment whose limits and tenant API key were set through the operator tools, every role stopped,
    When Redis comes back empty and the operator runs `streams state recover` (or `acknowledge-loss`) before any
    role started (no guard saw the loss),
    Then the limits and the API key are back, and the epoch is written: before, the epoch came back alone, so the
    roles started next saw nothing lost and never restored them (every API key refused, no limits)."""
    channel_topics("email")
    keys, oplog = RedisKeys(namespace), OperatorLog(stack.bootstrap, oplog_topic)
    assert StateGuard(redis_client, keys, oplog, "api").check()  # a new deployment: the epoch written
    limits = LimitStore(redis_client, namespace, oplog)
    limits.set_provider("resend", 50, 50)
    before = limits.show("resend")
    token = ApiKeys(redis_client, namespace, oplog).create("tenant", "acme")
    lost = list(redis_client.scan_iter(f"{namespace}*"))
    assert redis_client.delete(*lost) == len(lost)

    if ends_the_hold == "recover":
        recover(stack.bootstrap, redis_client, names, keys, oplog)
    else:
        acknowledge_loss(redis_client, keys, oplog)

    assert limits.show("resend") == before and before["global_rate"] == 50
    assert ApiKeys(redis_client, namespace, oplog).resolve(token).tenant == "acme"
    assert redis_client.get(keys.epoch).decode() == log_epoch(oplog.snapshot())
    assert StateGuard(redis_client, keys, oplog, "worker").check(force=True)  # a role started next: all held
