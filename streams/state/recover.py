"""`streams state recover`: after Redis lost its data, rebuild what can be rebuilt from Kafka and
let dispatch resume.

`notif.outcomes` is the durable record of every terminal outcome: each `delivered` event of the
last 7 days becomes a `delivered` mark in processed_jobs again (so no send delivered before the
loss is sent twice when its message is read again; also for an event with a bad field of its own,
when its send id, tenant and status are good). So do the marks that keep a copy read again from being
sent, as far as the events prove them (`stop_mark`): `reconcile` for a send dead-lettered
`unknown_outcome` (the provider may hold it) or kept claimed by a request to be re-sent under its key (its
record, the body to re-send, is lost: a fresh request could go under another key, drawn into a batch anew, or
after the provider forgot the key), `tried:<n>` for a dead letter or a skipped delivery, and one attempt less
for a failed attempt going on; never over what says more, nor over a claim (a shard of a Redis Cluster that kept
its data keeps a request's claim, to be re-sent byte for byte). Every
event is applied to the send status store (one with a field of the wrong type is skipped, as the
outcome recorder skips it, and logged).
Then the operator log's epoch is written back to Redis (on a Redis Cluster with its marker in every
hash slot), which ends the hold; unless Redis lost its data again while recovery ran (a marker written
as it started is gone): then nothing ends the hold, and recovery is to be run again.
A replayed send whose status is rebuilt is marked replayed again (every replay carries `replay_of`,
from its `accepted` event on), so a bulk or dead-letter replay asked again does not send it twice.
What cannot be rebuilt: claims of requests that were in flight at the moment of the loss (their
outcome is unknown; they are sent again) and `accepted` statuses of sends the ingest API took (it
writes them to Redis only) that have no outcome yet; the SDK's are `accepted` events on the topic.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import orjson
import redis
from confluent_kafka import Consumer, Message, TopicPartition

from ..dispatch.idempotency import DELIVERED_TTL_S, ProcessedJobs
from ..errors import StackError, StoreUnavailable
from ..ingest.status import STATUS_TTL_S, StatusStore, UnusableOutcome, skip_outcome
from ..kafka_client import client_config, topic_partitions, watermarks
from ..names import RedisKeys, TopicNames
from ..outcomes import ACCEPTED, events_of, unidentified
from ..redis_client import is_cluster, store_errors
from .guard import log_epoch, restore, write_epoch
from .log import OperatorLog

log = logging.getLogger("streams.state.recover")


def stop_mark(event: dict) -> str | None:
    """The processed_jobs mark (other than `delivered`) an outcome event proves, None for none; never more than
    dispatch wrote. A dead letter `unknown_outcome` (the provider may hold the send) is `reconcile`, and so is a
    send going on while a request keeps it claimed (`kept`: only that request's body, lost with Redis's data, could
    be re-sent safely); a dead letter after n attempts (written before its event), or a delivery a worker skipped
    before attempt n+1 (its event counts the n made), `tried:<n>` / `tried:<n+1>`, and so a dead letter `too_old`
    written before attempt n+1 (no attempt of its own). A failed attempt n going on (`retrying`, `unknown`) proves
    only that its copy for attempt n was read (`tried:<n-1>`): the event and the copy carrying it on to n+1 are
    written apart, and a worker that died between them left the copy for n the only one (dispatch marks `tried:<n>`
    once both are)."""
    attempts = event.get("attempts")
    if not isinstance(attempts, int) or isinstance(attempts, bool):
        attempts = 0
    status = event["status"]
    if status in ("dead_lettered", "dropped") and event.get("reason") == "unknown_outcome":
        return "reconcile"
    if status == "skipped" and event.get("origin"):  # a worker's (ingest's skip a delivery never enqueued)
        return f"tried:{attempts + 1}"
    if status in ("dead_lettered", "dropped") and event.get("reason") == "too_old" and not event.get("attempt"):
        return f"tried:{attempts + 1}"  # found too old before attempt n+1 (dispatch marks that attempt)
    if status in ("dead_lettered", "dropped") and attempts > 0:
        return f"tried:{attempts}"
    if status in ("retrying", "unknown") and event.get("kept") is True:
        return "reconcile"
    if status in ("retrying", "unknown") and attempts > 1:
        return f"tried:{attempts - 1}"
    return None


@dataclass
class Recovery:
    events: int = 0
    delivered_marks: int = 0
    stop_marks: int = 0  # reconcile and tried:<n> marks (a copy read again is not sent)
    statuses: int = 0
    skipped: int = 0  # records not JSON, and events with a field of the wrong type (not recorded as statuses)
    replay_marks: int = 0  # sends marked replayed again (a bulk or dead-letter replay never replays them twice)


def _read_all(bootstrap: str, topic: str, handle: Callable[[Message], None]) -> None:
    # A start retention deleted after the watermarks were read is read on from the partition's new start (the
    # default would jump to its end, and recovery stall there).
    c = Consumer(client_config(bootstrap, quiet=True, settings={
        "group.id": f"state-recover-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False,
        "auto.offset.reset": "earliest"}))
    try:
        parts = topic_partitions(c, topic)
        ends, assignment = {}, []
        for p in parts:
            low, high = watermarks(c, TopicPartition(topic, p))
            if high > low:
                ends[p] = high
                assignment.append(TopicPartition(topic, p, low))
        c.assign(assignment)
        idle_since = time.monotonic()
        while ends:
            msgs = c.consume(num_messages=1000, timeout=0.1)  # a full batch or the timeout, whichever first
            if msgs:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > 30:
                raise StackError(f"reading {topic} stalled; {len(ends)} partition(s) unfinished")
            for m in msgs:
                if m.error():
                    continue
                handle(m)
            # A partition is read once the consumer's position reaches its end: a transaction's commit or
            # abort marker takes the last offset and is never returned, so no record need be seen there.
            for tp in c.position([TopicPartition(topic, p) for p in ends]):
                if tp.offset >= ends[tp.partition]:
                    del ends[tp.partition]
    finally:
        c.close()


def _ms(event: dict, name: str) -> int | None:
    """An event's time field in ms, when it is one (a positive integer)."""
    value = event.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def recover(bootstrap: str, client: redis.Redis, names: TopicNames, keys: RedisKeys, oplog: OperatorLog,
            progress: Callable[[str], None] = lambda m: None) -> Recovery:
    store = StatusStore(client, names.namespace)
    jobs = ProcessedJobs(client, names.namespace)
    result = Recovery()
    replays: dict[str, tuple[str, str]] = {}  # a replayed send's id: its (first seen) replay's id and tenant
    now_ms = int(time.time() * 1000)

    def skip(msg: Message, why: str) -> None:
        result.skipped += 1
        skip_outcome(msg, why, log)

    def apply(msg: Message) -> None:
        try:
            events = events_of(orjson.loads(msg.value())) if msg.value() is not None else []
        except orjson.JSONDecodeError:
            skip(msg, "not JSON")
            return
        for event in events:  # a record may hold several (one provider request's)
            apply_event(msg, event)

    def apply_event(msg: Message, event: dict) -> None:
        problem = unidentified(event)
        if problem:
            skip(msg, problem)
            return
        result.events += 1
        marked = ""
        # Its mark needs only the send, its tenant, its status (and the attempts, for tried:<n>).
        completed = _ms(event, "completed_at_ms") or now_ms  # unknown: kept a full week, never shorter
        left_s = DELIVERED_TTL_S - (now_ms - completed) / 1000  # claims are kept as long as delivered marks
        ttl_s = max(1, int(left_s))
        if event["status"] == "delivered" and left_s > 0:
            with store_errors("restoring a delivered mark"):
                client.set(keys.processed(event["tenant_id"], event["send_id"]), "delivered", ex=ttl_s)
            result.delivered_marks += 1
            marked = " (its delivered mark is rebuilt)"
        elif (mark := stop_mark(event)) is not None and left_s > 0:
            result.stop_marks += jobs.restore_mark(event["tenant_id"], event["send_id"], mark, ttl_s)
            marked = f" (its {mark} mark is rebuilt)"
        if isinstance(event.get("replay_of"), str) and event["replay_of"]:
            replays.setdefault(event["replay_of"], (event["send_id"], event["tenant_id"]))
        # A status is kept 30 days from its send's last event, as when it was first recorded: not 30 more days
        # from the recovery for every status rebuilt at once (Redis sized for 30 days would hold up to twice that).
        # An `accepted` event (no completion) is as old as its acceptance: one 31 days old brought back a send
        # delivered long ago as `accepted`, kept 30 more days.
        last = completed if event["status"] != ACCEPTED else (
            _ms(event, "accepted_at_ms") or _ms(event, "created_at_ms") or now_ms)
        status_left_s = STATUS_TTL_S - (now_ms - last) / 1000
        if status_left_s <= 0:
            return
        try:
            store.record_outcome(event, ttl_s=max(1, int(status_left_s)))
        except UnusableOutcome as exc:  # the outcome recorder skips it too
            skip(msg, f"{exc}{marked}")
        else:
            result.statuses += 1
        if result.events % 10_000 == 0:
            progress(f"{result.events} outcome events applied")

    def rebuild() -> None:
        _read_all(bootstrap, names.outcomes, apply)
        result.replay_marks = store.restore_replays(replays)

    _end_the_hold(client, keys, oplog, rebuild)
    return result


def acknowledge_loss(client: redis.Redis, keys: RedisKeys, oplog: OperatorLog) -> str:
    """End the hold without rebuilding the marks (the operator accepts that delivered sends may be re-sent); the
    operator state is restored all the same."""
    return _end_the_hold(client, keys, oplog, lambda: None)


def _end_the_hold(client: redis.Redis, keys: RedisKeys, oplog: OperatorLog, rebuild: Callable[[], None]) -> str:
    """This run's markers, then the operator state restored, then `rebuild`; then the epoch written back (ending
    the hold), returned, unless Redis lost its data again meanwhile (a marker is gone): then nothing ends the hold,
    and the run is to be made again."""
    run = uuid.uuid4().hex
    markers = [keys.recovering(run)] + (keys.recovering_markers(run) if is_cluster(client) else [])
    _write_markers(client, markers)
    try:
        _restore_operator_state(client, keys, oplog)
        rebuild()
        with store_errors("reading the recovery's markers"):
            lost = len(markers) - int(client.exists(*markers))
        if lost:
            raise StackError(f"Redis lost its data again while recovery ran ({lost} of its {len(markers)} markers "
                             "are gone): dispatch still holds; make Redis keep its data, then run `streams state "
                             "recover` again")
        epoch = log_epoch(oplog.snapshot()) or uuid.uuid4().hex
        write_epoch(client, keys, oplog, epoch)
        return epoch
    finally:  # each run's own: a run that failed leaves none behind either (best effort: Redis may be why)
        try:
            with store_errors("removing the recovery's markers"):
                client.delete(*markers)
        except StoreUnavailable as exc:
            log.warning("the recovery's markers were not removed (they expire in 7 days): %s", exc)


def _write_markers(client: redis.Redis, markers: list[str]) -> None:
    """One key per hash slot on a Redis Cluster (a master that loses its data takes its slots' markers along)."""
    pipe = client.pipeline(transaction=False)
    for key in markers:
        pipe.set(key, b"1", ex=7 * 24 * 3600)
    with store_errors("writing the recovery's markers"):
        pipe.execute()


def _restore_operator_state(client: redis.Redis, keys: RedisKeys, oplog: OperatorLog) -> None:
    """Limits, API keys, endpoints... back from the operator log if Redis lost them, as a role's guard restores them
    when it sees the loss: with every role down while Redis came back empty, no guard saw it, and none started once
    the epoch is back would (every API key refused, no limits). Only what Redis lacks, in hash slots not restored
    since they lost their data (`restore`)."""
    snapshot = oplog.snapshot()
    if log_epoch(snapshot) is not None:  # a deployment the log knows
        restore(client, keys, snapshot, "state recover")
