"""Send status for `GET /v1/sends/{id}`: written `accepted` at ingest, then kept current from
`notif.outcomes` by the outcome recorder (`streams outcome-recorder`). A Redis hash per send."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import orjson
import redis

from .. import metrics
from ..backoff import Outage
from ..errors import PublishError, StackError, StateLost, StoreUnavailable
from ..kafka_client import consume_ready, lane_consumer, store_message_offset
from ..names import RedisKeys, hash_slot
from ..outcomes import ACCEPTED, WHERE_KEYS, events_of, unusable, webhook_fields
from ..redis_client import is_cluster, load_script, ping_every_master, store_errors
from ..state.guard import UNREADABLE_LOG_EVERY_S

if TYPE_CHECKING:
    from ..state.guard import StateGuard

STATUS_TTL_S = 30 * 24 * 3600  # as long as notif.outcomes keeps outcomes
log = logging.getLogger("streams.outcome_recorder")


class UnusableOutcome(ValueError):
    """An outcome event with a field of the wrong type: it can never be recorded."""


# The statuses a send goes through: accepted at ingest; retrying (a definite failure, a retry is
# scheduled) or unknown (the last attempt's outcome is unknown: retried under the same key, or
# waiting for reconciliation); then delivered or dead_lettered, which are final.
FINAL = frozenset({b"delivered", b"dead_lettered", b"dropped", b"skipped"})  # also in record_status.lua
# A send's `replayed_as` while a replay of it is claimed, or was left unconfirmed by the broker (no replay id yet).
REPLAY_PENDING = "pending"


def skip_outcome(msg, why: str, logger: logging.Logger = log) -> None:
    """A record of notif.outcomes, or an event in it, that can never be recorded: skipped, counted,
    logged with why (the field) and its offset (the outcome recorder and `streams state recover`)."""
    metrics.OUTCOMES_SKIPPED.inc()
    logger.error("skipping an unusable outcome in %s[%d]@%d: %s", msg.topic(), msg.partition(), msg.offset(), why)


class StatusStore:
    """Status, attempt history and where a send's payload can be found, kept 30 days."""

    def __init__(self, client: redis.Redis, namespace: str = "", holds_data: Callable[[], bool] | None = None,
                 on_lost: Callable[[], None] | None = None):
        """`holds_data` (a state guard's check): replays are claimed only while it says Redis holds its data;
        `on_lost` (its `recheck`): a claim found the send's slot without its epoch marker."""
        self.client = client
        self.keys = RedisKeys(namespace)
        self.holds_data, self.on_lost = holds_data, on_lost
        self._record_status = client.register_script(load_script(__package__, "record_status.lua"))
        self._claim_replay = client.register_script(
            "if redis.call('EXISTS', KEYS[2]) == 0 then return -1 end "
            f"return redis.call('HSETNX', KEYS[1], 'replayed_as', '{REPLAY_PENDING}')")
        # Only a claim is freed: a replay id written meanwhile (a deliberate replay's) stays.
        self._release_replay = client.register_script(
            f"if redis.call('HGET', KEYS[1], 'replayed_as') == '{REPLAY_PENDING}' then "
            "return redis.call('HDEL', KEYS[1], 'replayed_as') end return 0")
        # A send's replay mark, only while it has a status of the replay's tenant (one step: its status may expire
        # in between), where it has only a replay's claim ("pending": the replay that claimed it is published, and
        # the call that published it could not record that) or, unless ARGV[3] is "1", none.
        self._mark_replayed_if_known = client.register_script(
            "local s = redis.call('HMGET', KEYS[1], 'tenant_id', 'replayed_as') "
            f"if s[1] ~= ARGV[2] or (s[2] and s[2] ~= '{REPLAY_PENDING}') or (not s[2] and ARGV[3] == '1') then "
            "return 0 end "
            "redis.call('HSET', KEYS[1], 'replayed_as', ARGV[1]) return 1")

    def accepted(self, sends: list) -> None:
        """Recorded once published: a status an outcome already wrote (the send can be dispatched
        before this runs) is never replaced by `accepted`. A webhook delivery is listed under its
        endpoint from here on, as its outcomes list it (it is found while it waits its turn)."""
        pipe = self.client.pipeline(transaction=False)
        now = int(time.time() * 1000)
        for s in sends:
            fields = {"tenant_id": s.tenant_id, "channel": s.channel, "lane": s.lane, "accepted_at_ms": now}
            if s.replay_of:
                fields["replay_of"] = s.replay_of
            fields.update({k: v for k, v in webhook_fields(s).items() if isinstance(v, str) and v})
            self._accept(pipe, s.send_id, fields, s.created_at_ms)
        with store_errors("recording accepted sends"):
            pipe.execute()

    def _accept(self, pipe, send_id: str, fields: dict, created_at_ms: int, ttl_s: int = STATUS_TTL_S) -> None:
        key = self.keys.send_status(send_id)
        if "endpoint_id" in fields:
            index = self.keys.endpoint_deliveries(str(fields["endpoint_id"]), str(fields["tenant_id"]))
            pipe.zadd(index, {send_id: created_at_ms})
            pipe.expire(index, STATUS_TTL_S)
        pipe.hset(key, mapping=fields)
        pipe.hsetnx(key, "status", ACCEPTED)
        pipe.hsetnx(key, "attempts", 0)
        # Only a status it created: one an outcome wrote keeps its time to live (30 days from the send's last
        # event; a recovery applying this after it set 30 days from the recovery, twice the statuses kept).
        pipe.expire(key, ttl_s, nx=True)

    def record_outcome(self, event: dict, ttl_s: int = STATUS_TTL_S) -> None:
        """Apply an outcome event (at least once: applying one twice changes nothing). A final status
        is never replaced by an intermediate one that arrives late. Raises UnusableOutcome, before
        writing anything, for an event with a field of the wrong type. The send's status and attempts
        are kept `ttl_s` from now (less than 30 days for an old event applied again by a recovery)."""
        problem = unusable(event)
        if problem:
            raise UnusableOutcome(problem)
        send_id = event["send_id"]
        if event["status"] == ACCEPTED:  # the SDK's: as `accepted` above, never over a status already there
            fields = {k: event[k] for k in ("tenant_id", "channel", "lane", "accepted_at_ms", "replay_of",
                                            "endpoint_id", "event_id", "event_type") if event.get(k)}
            pipe = self.client.pipeline(transaction=False)
            self._accept(pipe, send_id, fields, event.get("created_at_ms") or 0, ttl_s)
            self._note_replay(pipe, event)
            with store_errors("recording an accepted send"):
                pipe.execute()
            return
        key, attempts_key = self.keys.send_status(send_id), self.keys.send_attempts(send_id)
        fields = {"status": event["status"], "tenant_id": event["tenant_id"],
                  "completed_at_ms": event.get("completed_at_ms") or 0,
                  "provider": event.get("provider") or "", "reason": event.get("reason") or "",
                  "provider_message_id": event.get("provider_message_id") or ""}
        for name in ("attempts", "replay_of"):
            if event.get(name):
                fields[name] = event[name]
        if event.get("providers_tried"):  # every provider the send was tried on, in order
            fields["providers_tried"] = ",".join(event["providers_tried"])
        for prefix, where in (("origin", event.get("origin")), ("dlq", event.get("dlq"))):
            if isinstance(where, dict):
                fields.update({f"{prefix}_{k}": where[k] for k in WHERE_KEYS if k in where})
        attempt = None
        if isinstance(event.get("attempt"), dict):
            try:
                attempt = orjson.dumps(event["attempt"])
            except orjson.JSONEncodeError:  # read, but nested past what can be written back (255 levels)
                raise UnusableOutcome("'attempt' is nested too deep to be stored") from None
        with store_errors("recording an outcome"):
            pipe = self.client.pipeline(transaction=False)
            if attempt is not None:
                pipe.hset(attempts_key, str(event["attempt"].get("n")), attempt)
                pipe.expire(attempts_key, ttl_s)
            if event.get("endpoint_id"):  # a webhook delivery: listed under its endpoint, 30 days
                index = self.keys.endpoint_deliveries(event["endpoint_id"], event["tenant_id"])
                created = int(event.get("created_at_ms") or event.get("completed_at_ms") or 0)
                pipe.zadd(index, {send_id: created})
                pipe.zremrangebyscore(index, 0, created - STATUS_TTL_S * 1000)
                pipe.expire(index, STATUS_TTL_S)
                fields.update({k: event[k] for k in ("endpoint_id", "event_id", "event_type") if event.get(k)})
                if event["status"].encode() in FINAL:  # no longer part of the endpoint's backlog
                    pipe.zrem(self.keys.endpoint_backlog(event["endpoint_id"]), send_id)
            self._record_status(keys=[key], args=[event["status"], ttl_s, event.get("attempts") or "",
                                                  *(x for kv in fields.items() for x in kv)], client=pipe)
            self._note_replay(pipe, event)
            pipe.execute()

    def _note_replay(self, pipe, event: dict) -> None:
        """A replay's event names it on its original's replay mark left "pending" because the call that published
        it could not record it (Redis failed right after the publish, or the broker left the publish unconfirmed):
        the dead letter's next replay then answers with it instead of being refused as unconfirmed. An original with
        no mark stays unmarked (a replay asked alone marks its original itself)."""
        if event.get("replay_of"):
            self._mark_replayed_if_known(keys=[self.keys.send_status(event["replay_of"])],
                                         args=[event["send_id"], event["tenant_id"], "1"], client=pipe)

    def endpoint_deliveries(self, endpoint_id: str, tenant_id: str, limit: int = 100, before_ms: int | None = None,
                            after: tuple[int, str] | None = None) -> list[tuple[str, int]]:
        """A tenant's deliveries to an endpoint with when each was created, newest first (by time, then by id, both
        descending): created before `before_ms`, or listed after `after`, the (time, id) of the last one a caller
        read. Reading on by time alone would skip the rest of the millisecond a page ended in (a batch's events
        share one), by position would shift as deliveries are added. The legacy index's entries (every tenant's)
        are read alongside: the caller keeps the tenant's own."""
        pipe = self.client.pipeline(transaction=False)
        for key in (self.keys.endpoint_deliveries(endpoint_id, tenant_id),
                    self.keys.legacy_endpoint_deliveries(endpoint_id)):
            if after is None:
                top = f"({before_ms}" if before_ms is not None else "+inf"
                pipe.zrevrangebyscore(key, top, "-inf", start=0, num=limit, withscores=True)
            else:
                pipe.zrevrangebyscore(key, after[0], after[0], withscores=True)  # that millisecond's, reverse order
                pipe.zrevrangebyscore(key, f"({after[0]}", "-inf", start=0, num=limit, withscores=True)
        with store_errors("listing an endpoint's deliveries"):
            answers = pipe.execute()
        found = {(i.decode(), int(score)) for answer in answers for i, score in answer
                 if after is None or score < after[0] or i < after[1].encode()}
        return sorted(found, key=lambda d: (d[1], d[0].encode()), reverse=True)[:limit]

    def endpoint_deliveries_between(self, endpoint_id: str, tenant_id: str, since_ms: int, until_ms: int,
                                    limit: int) -> list[tuple[str, int]]:
        """A tenant's first `limit` deliveries to an endpoint created in [since_ms, until_ms), oldest first, with
        when each was created (a busy endpoint lists millions in 30 days: one call never reads them all). The
        legacy index's entries (every tenant's) are read alongside: the caller keeps the tenant's own."""
        pipe = self.client.pipeline(transaction=False)
        for key in (self.keys.endpoint_deliveries(endpoint_id, tenant_id),
                    self.keys.legacy_endpoint_deliveries(endpoint_id)):
            pipe.zrangebyscore(key, since_ms, f"({until_ms}", start=0, num=limit, withscores=True)
        with store_errors("listing an endpoint's deliveries"):
            answers = pipe.execute()
        found = {(i.decode(), int(score)) for answer in answers for i, score in answer}
        return sorted(found, key=lambda d: (d[1], d[0].encode()))[:limit]

    def claim_replay(self, send_id: str) -> bool:
        """True once per send: a bulk replay called twice replays each send once. Never while Redis has lost its
        data: `streams state recover` rebuilds statuses (a dead letter reads dead-lettered again) before the marks
        of the replays made before the loss, and a claim in between would replay a replayed send again."""
        self.require_data()
        status = self.keys.send_status(send_id)
        with store_errors("claiming a replay"):
            if self.holds_data is None:
                return bool(self.client.hsetnx(status, "replayed_as", REPLAY_PENDING))
            # The guard's answer may be seconds old: the claim itself also needs the epoch (its marker in the
            # status's slot, on a Redis Cluster), which `streams state recover` writes back last.
            marker = self.keys.epoch_marker(hash_slot(send_id)) if is_cluster(self.client) else self.keys.epoch
            claimed = self._claim_replay(keys=[status, marker])
        if claimed == -1:
            if self.on_lost is not None:  # the guard's next look reads every marker (a lost slot it had not seen)
                self.on_lost()
            raise StateLost("Redis has lost its data (no epoch where the send's status is) and `streams state "
                            "recover` has not finished: no replay is claimed until then")
        return bool(claimed)

    def require_data(self) -> None:
        """StateLost while Redis has lost its data and `streams state recover` has not finished."""
        if self.holds_data is None:
            return
        try:
            intact = self.holds_data()
        except StackError as exc:  # the operator log is unreadable: whether data was lost is unknown
            raise StoreUnavailable(f"cannot tell whether Redis holds its data ({exc}); no replay is claimed") from None
        if not intact:
            raise StateLost("Redis has lost its data and `streams state recover` has not finished: the marks of "
                            "replays made before the loss may not be back yet, so no replay is claimed until then")

    def release_replay(self, send_id: str) -> None:
        """Its replay published nothing: a later bulk replay may replay it (only the claim's holder calls this). A
        replay id written over the claim meanwhile (a deliberate replay, asked alone) is kept."""
        with store_errors("releasing a replay"):
            self._release_replay(keys=[self.keys.send_status(send_id)], client=self.client)

    def restore_replays(self, replays: dict[str, tuple[str, str]], chunk: int = 1000) -> int:
        """`state recover`: mark each send of `replays` (send id: its replay's id and tenant) replayed, unless it is
        marked already or has no status of that tenant (a send whose own outcomes are gone gets no status of a
        replay's). How many were marked."""
        ids, marked = list(replays), 0
        with store_errors("restoring replay marks"):
            for i in range(0, len(ids), chunk):
                pipe = self.client.pipeline(transaction=False)
                for send_id in ids[i:i + chunk]:
                    self._mark_replayed_if_known(keys=[self.keys.send_status(send_id)],
                                                 args=[*replays[send_id], "0"], client=pipe)
                marked += sum(pipe.execute())
        return marked

    def mark_replayed(self, send_id: str, replay_id: str) -> None:
        with store_errors("recording a replay"):
            self.client.hset(self.keys.send_status(send_id), "replayed_as", replay_id)

    def mark_replayed_alone(self, send_id: str, replay_id: str, tenant: str) -> None:
        """A replay asked alone (which may be asked again: it claims nothing): marked, unless marked already, so that
        a bulk replay passes the send over; only while the send has a status of `tenant`."""
        with store_errors("recording a replay"):
            self._mark_replayed_if_known(keys=[self.keys.send_status(send_id)], args=[replay_id, tenant, "0"])

    def ping(self) -> None:
        """Whether Redis answers (StoreUnavailable if not), every master of a Redis Cluster."""
        with store_errors("asking Redis whether it answers"):
            ping_every_master(self.client)

    def unsettled(self, send_ids: Sequence[str]) -> list[str]:
        """Those of `send_ids` whose status is not final (one with none recorded yet is not), in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        for send_id in send_ids:
            pipe.hget(self.keys.send_status(send_id), "status")
        with store_errors("reading sends' statuses"):
            statuses = pipe.execute()
        return [s for s, status in zip(send_ids, statuses, strict=True) if status not in FINAL]

    def get(self, send_id: str) -> dict | None:
        with store_errors("reading a send's status"):
            raw = self.client.hgetall(self.keys.send_status(send_id))
            attempts = self.client.hgetall(self.keys.send_attempts(send_id))
        if not raw:
            return None
        doc: dict = {k.decode(): v.decode() for k, v in raw.items()}
        for k in ("attempts", "accepted_at_ms", "completed_at_ms", "origin_partition", "origin_offset",
                  "dlq_partition", "dlq_offset"):
            if k in doc:
                doc[k] = int(doc[k] or 0)
        doc["attempt_history"] = sorted((orjson.loads(v) for v in attempts.values()), key=lambda a: a.get("n") or 0)
        return doc


class OutcomeRecorder:
    """Consumes notif.outcomes into the status store (at-least-once; applying twice is harmless).
    When Redis fails, the recorder pauses its partitions, keeps the unrecorded events and tries
    them again with backoff; an offset is stored only once its event is recorded."""

    def __init__(self, bootstrap: str, store: StatusStore, topic: str, group: str, guard: StateGuard | None = None):
        self.store = store
        self.guard = guard
        self.topic = topic
        self.consumer = lane_consumer(bootstrap, group)
        self.outage = Outage("Redis (outcome recorder)")
        self.backlog: list = []  # consumed, not yet recorded
        self.running = True
        self._log_unreadable_at = 0.0  # when an unreadable operator log may be logged again
        self._down = metrics.DEPENDENCY_DOWN.labels("outcome-recorder", "redis")

    def stop(self, *_: object) -> None:
        self.running = False

    def run(self, until: Callable[[], bool] | None = None) -> None:
        self.consumer.subscribe([self.topic], on_revoke=self._forget, on_lost=self._forget)
        try:
            while self.running and not (until and until()):
                self.step()
        finally:
            self.consumer.close()

    def _forget(self, _consumer, partitions) -> None:
        gone = {(p.topic, p.partition) for p in partitions}
        self.backlog = [m for m in self.backlog if (m.topic(), m.partition()) not in gone]

    def step(self) -> None:
        self._check_state()
        msgs = consume_ready(self.consumer, 500, 0.2)
        self.backlog.extend(m for m in msgs if not m.error())
        if self.outage.ready(time.monotonic()):
            if self.backlog:
                self._record()
            elif self.outage.active:
                self._probe()
        self._down.set(1 if self.outage.active else 0)

    def _probe(self) -> None:
        """Held with nothing left to record (a rebalance took the partitions of what was kept, or the state check
        failed on a quiet topic): nothing would ever resume the partitions, nor clear the outage, but this."""
        try:
            self.store.ping()
        except StoreUnavailable as exc:
            self.outage.failed(time.monotonic(), exc)
            return
        self.outage.recovered(time.monotonic())
        self.consumer.resume(self.consumer.assignment())

    def _check_state(self) -> None:
        """Rebuild operator state by itself if Redis lost its data (statuses keep being recorded). While Redis does
        not answer, nothing more is fetched (what the polls read waited in memory, the whole backlog of a recorder
        started during an outage); an operator log it cannot read does not stop statuses being recorded."""
        if self.guard is None or not self.outage.ready(time.monotonic()):
            return
        try:
            self.guard.check()
        except StackError as exc:
            if (now := time.monotonic()) >= self._log_unreadable_at:
                self._log_unreadable_at = now + UNREADABLE_LOG_EVERY_S
                log.warning("cannot check Redis state against the operator log (statuses are recorded all the "
                            "same): %s", exc)
        except (StoreUnavailable, PublishError) as exc:
            self.outage.failed(time.monotonic(), exc)
            self.consumer.pause(self.consumer.assignment())  # resumed by the next record written, or the probe

    def _record(self) -> None:
        while self.backlog:
            msg = self.backlog[0]
            try:
                events = events_of(orjson.loads(msg.value())) if msg.value() is not None else []  # may hold several
            except orjson.JSONDecodeError:
                events = []
                skip_outcome(msg, "not JSON")
            try:
                for event in events:  # again from the first after a Redis error: applying twice is harmless
                    try:
                        self.store.record_outcome(event)
                    except UnusableOutcome as exc:  # the others of its record are still recorded
                        skip_outcome(msg, str(exc))
                    else:
                        metrics.OUTCOMES_RECORDED.labels(event["status"]).inc()
            except StoreUnavailable as exc:
                self.outage.failed(time.monotonic(), exc)
                self.consumer.pause(self.consumer.assignment())  # fetch nothing more meanwhile
                return
            store_message_offset(self.consumer, msg)
            self.backlog.pop(0)
        if self.outage.active:
            self.outage.recovered(time.monotonic())
            self.consumer.resume(self.consumer.assignment())
