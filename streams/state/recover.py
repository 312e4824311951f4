"""`streams state recover`: after Redis lost its data, rebuild what can be rebuilt from Kafka and
let dispatch resume.

`notif.outcomes` is the durable record of every terminal outcome: each `delivered` event of the
last 7 days becomes a `delivered` mark in processed_jobs again (so no send delivered before the
loss is sent twice when its message is read again; also for an event with a bad field of its own,
when its send id, tenant and status are good). So do the marks that keep a copy read again from being
sent: a send dead-lettered `unknown_outcome` is marked `reconcile` (the provider may hold it), and a
failed attempt n (retrying, unknown, dead-lettered) or a skipped delivery `tried:<n>` (its copies for
attempt n or earlier are stale), never over what says more. Every event is applied to the send status
store (one with a field of the wrong type is skipped, as the outcome recorder skips it, and logged).
Then the operator log's epoch is written back to Redis (on a Redis Cluster with its marker in every
hash slot), which ends the hold.
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

from ..dispatch.idempotency import DELIVERED_TTL_S
from ..errors import StackError
from ..ingest.status import StatusStore, UnusableOutcome, skip_outcome
from ..kafka_client import client_config, watermarks
from ..names import RedisKeys, TopicNames
from ..outcomes import events_of, unidentified
from ..redis_client import store_errors
from .guard import log_epoch, write_epoch
from .log import OperatorLog

log = logging.getLogger("streams.state.recover")
# A mark that keeps a copy read again from being sent, unless the key says more already (`delivered`, `reconcile`,
# or `tried:<m>` with m >= n): as dispatch writes them (mark_tried.lua).   KEYS[1] processed_jobs key
# ARGV[1] `reconcile` or `tried:<n>`   ARGV[2] ttl (s)
_MARK_UNLESS_MORE = """
local state = redis.call('GET', KEYS[1])
if state == 'delivered' or state == 'reconcile' then return 0 end
if state and string.sub(state, 1, 6) == 'tried:' and string.sub(ARGV[1], 1, 6) == 'tried:'
   and tonumber(string.sub(state, 7)) >= tonumber(string.sub(ARGV[1], 7)) then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return 1
"""


def stop_mark(event: dict) -> str | None:
    """The processed_jobs mark (other than `delivered`) an outcome event leaves, as dispatch wrote it: None for
    none. A dead letter `unknown_outcome` (the provider may hold the send) is `reconcile`; a failed attempt n,
    or a delivery skipped before attempt n+1 (its event counts the n attempts made), `tried:<n>` / `tried:<n+1>`."""
    attempts = event.get("attempts")
    if not isinstance(attempts, int) or isinstance(attempts, bool):
        attempts = 0
    status = event["status"]
    if status in ("dead_lettered", "dropped") and event.get("reason") == "unknown_outcome":
        return "reconcile"
    if status == "skipped":
        return f"tried:{attempts + 1}"
    if status in ("retrying", "unknown", "dead_lettered", "dropped") and attempts > 0:
        return f"tried:{attempts}"
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
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
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


def recover(bootstrap: str, client: redis.Redis, names: TopicNames, keys: RedisKeys, oplog: OperatorLog,
            progress: Callable[[str], None] = lambda m: None) -> Recovery:
    store = StatusStore(client, names.namespace)
    mark_unless_more = client.register_script(_MARK_UNLESS_MORE)
    result = Recovery()
    replays: dict[str, str] = {}  # a replayed send's id: its (first seen) replay's
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
        completed = event.get("completed_at_ms")
        if not isinstance(completed, int) or isinstance(completed, bool) or completed <= 0:
            completed = now_ms  # unknown: kept a full week, never shorter
        age_s = (now_ms - completed) / 1000
        processed = keys.processed(event["tenant_id"], event["send_id"])
        if event["status"] == "delivered" and age_s < DELIVERED_TTL_S:
            with store_errors("restoring a delivered mark"):
                client.set(processed, "delivered", ex=max(1, int(DELIVERED_TTL_S - age_s)))
            result.delivered_marks += 1
            marked = " (its delivered mark is rebuilt)"
        elif (mark := stop_mark(event)) is not None and age_s < DELIVERED_TTL_S:  # claims are kept as long
            ttl_s = max(1, int(DELIVERED_TTL_S - age_s))
            with store_errors("restoring a send's mark"):
                result.stop_marks += mark_unless_more(keys=[processed], args=[mark, ttl_s])
            marked = f" (its {mark} mark is rebuilt)"
        if isinstance(event.get("replay_of"), str) and event["replay_of"]:
            replays.setdefault(event["replay_of"], event["send_id"])
        try:
            store.record_outcome(event)
        except UnusableOutcome as exc:  # the outcome recorder skips it too
            skip(msg, f"{exc}{marked}")
        else:
            result.statuses += 1
        if result.events % 10_000 == 0:
            progress(f"{result.events} outcome events applied")

    _read_all(bootstrap, names.outcomes, apply)
    result.replay_marks = store.restore_replays(replays)
    write_epoch(client, keys, oplog, log_epoch(oplog.snapshot()) or uuid.uuid4().hex)
    return result


def acknowledge_loss(client: redis.Redis, keys: RedisKeys, oplog: OperatorLog) -> str:
    """End the hold without rebuilding (the operator accepts that delivered sends may be re-sent)."""
    epoch = log_epoch(oplog.snapshot()) or uuid.uuid4().hex
    write_epoch(client, keys, oplog, epoch)
    return epoch
