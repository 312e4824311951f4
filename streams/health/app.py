"""`streams endpoint-health`: the faust-streaming app that keeps every webhook endpoint's health.
The only module that imports faust; the data plane does not depend on it.

It consumes `notif.webhook.attempts` (key = endpoint id) and keeps one row per endpoint in a
faust table (`health`, changelog topic `<app id>-health-changelog`): consecutive failures, state,
last error, alert window. The rules are `rules.py`; this module does their I/O:

- an alert goes out as a send on our own email transactional lane, to every member of the
  endpoint's project, with a send id derived from (endpoint, incident, kind, window): re-sent after
  a restart, dispatch recognises it and never delivers it twice;
- a state change is published to the compacted `notif.endpoint.state`, which webhook workers and
  ingest follow;
- only then is the row written. Faust commits the source offset after the changelog write is
  acknowledged (at least once), so an event is applied again only when the app died before its
  commit; the row remembers the offset it has applied (`applied_upto`, in `applied_partition`), and an event at
  or below it in that partition changes nothing. An event whose alert went out but whose row was not written is
  applied again and its alert sent again under the same send id.
- faust can lose the records it fetched as a rebalance's recovery completes; when nothing more
  arrives on that partition, the app reads it again from its committed offset (checked every
  STALL_CHECK_S; see `stall.py`, which also says what this does not cover). It can lose a
  changelog's records during a recovery too; recovery would then wait for them for good: the app
  reads that changelog partition again.

Settings and why: `store="memory://"` (the table is small, one row per endpoint; it is rebuilt from
the changelog on start and on every rebalance, so no local disk state can disagree with the
changelog); `processing_guarantee="at_least_once"` (faust's exactly-once producer transactions are
not needed: the offset check and the stable send ids make a replayed event harmless); the table's
partitions equal the attempts topic's (faust writes a row to the changelog partition of the event
that changed it); a 10 s session timeout, so a copy killed with kill -9 hands its endpoints to the
others within about 10 s; one standby replica, so the survivor already holds most rows.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import faust
import orjson
from faust.types import TP

from .. import metrics
from ..config import Config
from ..errors import StackError
from ..kafka_client import partition_for
from ..lag.reader import LagReader
from ..retry.policy import load_routing
from ..send import SCHEMA_VERSION, Send, encode
from ..topology.admin import TopicAdmin
from ..topology.spec import TopicSpec, load_definitions
from ..webhooks.endpoints import EndpointDirectory
from ..webhooks.model import with_health
from .budget import AlertBudget
from .rules import Alert, Health, Outcome, alert_email, apply, deletion_event, state_doc
from .stall import RecoveryWatch, StallWatch

log = logging.getLogger("streams.endpoint_health")
ALERT_TEMPLATE = "endpoint-alert"
SEND_RETRY_MAX_S = 5.0
UNACKNOWLEDGED_S = 10.0  # a send not acknowledged this long: the broker is said to be down while it waits
STALL_CHECK_S = 5.0
# A deleted endpoint's attempts still in flight are ignored this long after the deletion (no row, no alert); its
# row, if it had one, is removed within a check (STALL_CHECK_S) of it.
DELETED_KEPT_S = 3600.0


class EndpointHealthApp:
    def __init__(self, config: Config, directory: EndpointDirectory, data_dir: Path | None = None):
        self.config, self.names, self.directory = config, config.names, directory
        self.alert_budget = AlertBudget()
        self.unacknowledged_s = UNACKNOWLEDGED_S  # a test shortens it
        topics = load_definitions(namespace=config.namespace, profile=config.topic_profile)
        attempts = self.attempts_spec = topics[self.names.webhook_attempts]
        self.app = _App(
            self.names.endpoint_health_app,
            broker=[f"kafka://{server}" for server in config.bootstrap.split(",")],
            store="memory://",
            processing_guarantee="at_least_once",
            topic_partitions=attempts.partitions,
            topic_replication_factor=attempts.replication_factor,
            table_standby_replicas=1,
            broker_session_timeout=10.0,
            broker_heartbeat_interval=1.0,
            broker_commit_interval=1.0,
            consumer_auto_offset_reset="earliest",
            producer_acks=-1,
            web_enabled=False,
            datadir=str(data_dir or Path(tempfile.gettempdir()) / f"{self.names.endpoint_health_app}-data"),
        )
        self.attempts = self.app.topic(self.names.webhook_attempts, key_type=bytes, value_type=bytes,
                                       key_serializer="raw", value_serializer="raw",
                                       partitions=attempts.partitions)
        # Keys are endpoint ids (str: read back from the changelog as str too, not as the raw bytes a
        # key without a type comes back as, which would miss every row after a recovery); rows are
        # JSON documents (the app's default value serializer).
        self.table = self.app.Table("health", default=None, partitions=attempts.partitions, key_type=str)
        self.app.agent(self.attempts, name="endpoint-health")(self._follow)
        self.app.timer(2.0)(self._report)
        self.app.timer(STALL_CHECK_S)(self._reread_stalled)
        self.app.timer(STALL_CHECK_S)(self._remove_deleted)
        directory.remember_deleted_s = DELETED_KEPT_S
        self.removal_asked: set[str] = set()  # deleted endpoints whose deletion event is written, not yet applied
        # The operator's policy file, as ingest reads it: the packaged one may name a policy the workers do not know,
        # which they would dead-letter as `unknown_policy` (every alert lost, counted as sent).
        self.routing = load_routing(config.retry_policies_path)
        self.stalls = StallWatch()
        self.recovery_stalls = RecoveryWatch()
        self.app.while_recovering = self._check_recoveries
        self.taken: dict[int, int] = {}  # attempts partition -> events the agent took from it
        self.busy = False                # the agent holds an event
        # The group's committed offsets and the partitions' ends, asked on a thread of their own.
        self._offsets: LagReader | None = None
        self._offsets_thread = ThreadPoolExecutor(1, thread_name_prefix="health-offsets")

    # ------------------------------------------------------------------ the agent
    async def _follow(self, stream: Any) -> None:
        async for event in stream.events():
            partition = event.message.partition
            self.taken[partition], self.busy = self.taken.get(partition, 0) + 1, True
            try:
                await self._apply(event)
            finally:
                self.busy = False

    async def _apply(self, event: Any) -> None:
        """One attempt event (or reactivation, or deletion) into the table, after its effects."""
        await self._caught_up()
        try:  # UnicodeDecodeError and orjson's errors are ValueErrors
            endpoint_id = (event.key or b"").decode() if isinstance(event.key, bytes) else str(event.key or "")
            doc = orjson.loads(event.value)
            if not endpoint_id or not isinstance(doc, dict) or not _typed(doc):
                raise ValueError("not an attempt event")
            if doc.get("kind") == "deleted" or self._deleted(endpoint_id):
                await self._of_deleted(endpoint_id, doc)
                return
            row = self.table.get(endpoint_id)
            before = Health.from_doc(row) if row else Health(endpoint_id)
            ep = self.directory.endpoints.get(endpoint_id)
            if ep is not None and before.tenant != ep.tenant:  # the endpoint's own tenant, never an event's
                before = replace(before, tenant=ep.tenant)
            outcome = apply(before, doc, event.message.offset, event.message.partition)
        except (ValueError, TypeError, AttributeError, KeyError):
            metrics.HEALTH_EVENTS.labels("malformed").inc()
            log.warning("ignoring a malformed event at %s[%d]@%d", event.message.topic, event.message.partition,
                        event.message.offset)
            return
        if outcome.health is before:
            metrics.HEALTH_EVENTS.labels("replayed").inc()
            return
        metrics.HEALTH_EVENTS.labels("reactivated" if doc.get("kind") == "reactivated" else "attempt").inc()
        await self._act(outcome, doc)
        if outcome.health != _with_offset(before, outcome.health):
            self.table[endpoint_id] = outcome.health.to_doc()  # after its effects (see the module docstring)

    def _deleted(self, endpoint_id: str) -> bool:
        """Deleted lately (the operator log says so, and holds no endpoint of that id since)."""
        return endpoint_id in self.directory.deleted and endpoint_id not in self.directory.endpoints

    async def _of_deleted(self, endpoint_id: str, doc: dict) -> None:
        """An event of a deleted endpoint: its deletion event removes its row; an attempt in flight as it was deleted
        neither brings the row back nor alerts its tenant. An endpoint that exists keeps its row, whatever an event
        says."""
        if doc.get("kind") != "deleted":
            metrics.HEALTH_EVENTS.labels("of_deleted").inc()
            return
        self.removal_asked.discard(endpoint_id)
        if endpoint_id in self.directory.endpoints or self.table.get(endpoint_id) is None:
            return
        await self._produce(self.names.endpoint_state, endpoint_id.encode(), None, [])
        del self.table[endpoint_id]
        metrics.HEALTH_EVENTS.labels("deleted").inc()
        log.info("endpoint %s was deleted: its health row is removed", endpoint_id)

    async def _remove_deleted(self) -> None:
        """Each endpoint deleted lately that has a row here gets a deletion event on the attempts topic, once: only
        the agent may change the table, and it removes the row in line with the endpoint's attempts. The event goes
        to the partition the row was written from (its changelog partition, where the tombstone must go: faust
        writes a row's changes to its event's partition), which this producer's partitioner would not choose."""
        self.directory.poll()
        recent = self.directory.recently_deleted()
        self.removal_asked &= set(recent)  # one another copy removed (its partition moved) is not awaited for ever
        for endpoint_id in recent:
            if endpoint_id in self.removal_asked or (row := self.table.get(endpoint_id)) is None:
                continue
            key = endpoint_id.encode()
            partition = Health.from_doc(row).applied_partition
            if partition < 0:  # a row written before rows said it: where dispatch writes the endpoint's attempts
                partition = partition_for(key, self.attempts_spec.partitions)
            event = deletion_event(endpoint_id, int(time.time() * 1000))
            await self._produce(self.names.webhook_attempts, key, orjson.dumps(event), [], partition)
            self.removal_asked.add(endpoint_id)

    async def _caught_up(self) -> None:
        """Alerts name the endpoint and go to its members: know them before deciding anything."""
        self.directory.poll()
        while not self.directory.caught_up:
            await asyncio.sleep(0.05)
            self.directory.poll()

    async def _act(self, outcome: Outcome, event: dict) -> None:
        h = outcome.health
        if outcome.counted:  # not one of ours (a secret unreadable), held, nor another tenant's
            metrics.CONSECUTIVE_FAILURES.observe(h.consecutive_failures)
        for kind in outcome.suppressed:
            metrics.HEALTH_ALERTS.labels(kind, "suppressed").inc()
            log.info("alert %s for endpoint %s suppressed: one alert per endpoint per 24 h", kind, h.endpoint_id)
        # The state first: an alert our own email lane cannot take yet (its produce retried until it can) must not
        # hold back the degradation it announces, which stops deliveries to a failing endpoint.
        if outcome.state_changed:
            if h.state == "degraded":
                metrics.DEGRADATIONS.inc()
            log.warning("endpoint %s of tenant %s is now %s", h.endpoint_id, h.tenant, h.state)
            await self._produce(self.names.endpoint_state, h.endpoint_id.encode(), orjson.dumps(state_doc(h)), [])
        for alert in outcome.alerts:
            await self._send_alert(h, alert)

    async def _send_alert(self, h: Health, alert: Alert) -> None:
        members = list(self.directory.members.get(h.tenant, ()))
        if not members:
            metrics.HEALTH_ALERTS.labels(alert.kind, "no_members").inc()
            log.warning("alert %s for endpoint %s not sent: project %s has no members (PUT /v1/members)",
                        alert.kind, h.endpoint_id, h.tenant)
            return
        if not self.alert_budget.take(h.tenant, alert.kind, time.monotonic()):
            metrics.HEALTH_ALERTS.labels(alert.kind, "over_budget").inc()
            log.warning("alert %s for endpoint %s not sent: project %s had %d %s alerts in the last hour",
                        alert.kind, h.endpoint_id, h.tenant, self.alert_budget.per_hour, alert.kind)
            return
        ep = self.directory.endpoints.get(h.endpoint_id)
        payload = alert_email(alert.kind, h.endpoint_id, ep.url if ep else "(deleted)", h.tenant, h.last_error,
                              members, self.config.alerts_from, alert.reason, alert.attempts)
        send = Send(v=SCHEMA_VERSION, send_id=alert.send_id, tenant_id=self.config.alerts_tenant, channel="email",
                    category="transactional", lane="transactional",
                    policy=self.routing.policy_for("email", "transactional", ALERT_TEMPLATE),
                    template_id=ALERT_TEMPLATE, template_version="1", payload=payload,
                    created_at_ms=int(time.time() * 1000), correlation_id=h.endpoint_id)
        await self._produce(self.names.lane("email", "transactional"), send.tenant_id.encode(), encode(send),
                            [("send_id", send.send_id.encode())])
        metrics.HEALTH_ALERTS.labels(alert.kind, "sent").inc()
        log.warning("alert %s for endpoint %s sent as %s", alert.kind, h.endpoint_id, alert.send_id)

    async def _produce(self, topic: str, key: bytes, value: bytes | None, headers: list,
                       partition: int | None = None) -> None:
        """Until the broker acknowledges it: the row is written only after its effects."""
        wait = 0.1
        while True:
            try:
                await self._acknowledged(topic, key, value, headers, partition)
                metrics.DEPENDENCY_DOWN.labels("endpoint-health", "kafka").set(0)
                return
            except Exception as exc:  # noqa: BLE001 - any failure: the same record again, later
                metrics.DEPENDENCY_DOWN.labels("endpoint-health", "kafka").set(1)
                log.warning("publishing to %s failed (%s); trying again in %.1f s", topic, exc, wait)
                await asyncio.sleep(wait)
                wait = min(wait * 2, SEND_RETRY_MAX_S)

    async def _acknowledged(self, topic: str, key: bytes, value: bytes | None, headers: list,
                            partition: int | None = None) -> None:
        """One send, awaited until the broker answers. The producer's own timeout is faust's 20 minutes (the
        changelog's writes ride on it too): past UNACKNOWLEDGED_S without an answer, the broker is said to be down
        (gauge and a log line, again each UNACKNOWLEDGED_S), and the send goes on waiting, cancelled only with its
        caller (a shutdown)."""
        sending = asyncio.ensure_future(self.app.producer.send_and_wait(topic, key, value, partition, None, headers))
        waited = 0.0
        try:
            while not (await asyncio.wait({sending}, timeout=self.unacknowledged_s))[0]:
                waited += self.unacknowledged_s
                metrics.DEPENDENCY_DOWN.labels("endpoint-health", "kafka").set(1)
                log.warning("publishing to %s: no acknowledgement from the broker after %.0f s; still waiting", topic,
                            waited)
        except asyncio.CancelledError:  # the agent stops (a shutdown): the send with it, not left unwatched
            sending.cancel()
            raise
        sending.result()

    # ------------------------------------------------------------------ stalled partitions
    async def _reread_stalled(self) -> None:
        """Read again, from its committed offset, an attempts partition whose records never reached the
        agent and after which nothing came (see `stall.py`)."""
        topic = self.names.webhook_attempts
        try:
            assignment = self.app.consumer.assignment()
        except Exception as exc:  # noqa: BLE001 - e.g. the consumer not started yet: an exception would end the app
            log.info("assignment not known yet: %s", exc)
            return
        partitions = sorted(tp.partition for tp in assignment if tp.topic == topic)
        if self.app.rebalancing or not partitions:
            return
        generation, taken, busy = self.app.consumer_generation_id, dict(self.taken), self.busy
        try:
            offsets = await self._ask(topic, partitions)
        except Exception as exc:  # noqa: BLE001 - the broker cannot say now: ask again at the next check
            log.info("committed offsets of %s not read: %s", topic, exc)
            self.stalls.forget()
            return
        behind = {p: start for p, (start, end) in offsets.items() if end > start}
        busy = busy or self.busy or self.app.rebalancing or generation != self.app.consumer_generation_id
        if behind:  # what a stalled partition's check saw (a takeover that applied nothing left no trace)
            log.info("stall check (generation %s): partitions behind from their committed offsets %s; agent busy: "
                     "%s; events taken %s", generation, behind, busy, taken)
        for partition, offset in self.stalls.observe(generation, taken, busy, behind).items():
            if await self._read_again(topic, partition, offset):
                self.stalls.reread(partition, offset)

    async def _read_again(self, topic: str, partition: int, offset: int) -> bool:
        """Seek the partition back to `offset` (on faust's consumer thread); False: not done."""
        tp = TP(topic, partition)
        try:
            if self.app.rebalancing or tp not in self.app.consumer.assignment():
                return False
            await self.app.consumer.seek_wait({tp: offset})
        except Exception as exc:  # noqa: BLE001 - e.g. revoked meanwhile: the next owner reads it from there
            log.warning("could not read %s[%d] again from %d: %s", topic, partition, offset, exc)
            return False
        metrics.HEALTH_REREADS.labels("attempts").inc()
        log.warning("%s[%d] made no progress past its committed offset %d at two checks while the agent was "
                    "idle (records faust lost in a rebalance): reading them again", topic, partition, offset)
        return True

    async def _check_recoveries(self) -> None:
        """Every STALL_CHECK_S from the app's start: faust's own timers start only once the first
        recovery has completed, and that one can wait for dropped records too."""
        while not self.app.should_stop:
            await self.app.sleep(STALL_CHECK_S)
            try:
                await self._unstick_recovery()
            except Exception:  # noqa: BLE001 - the check must go on (and never end the app)
                log.exception("checking the table recovery failed")

    async def _unstick_recovery(self) -> None:
        """Read again a changelog partition whose recovery waits for records faust fetched and dropped
        (see `stall.py`)."""
        tables: Any = self.app.tables  # faust's TableManager (its type does not declare `recovery`)
        recovery = tables.recovery
        moment = (self.app.consumer_generation_id, self.app.rebalancing_count)

        def same_recovery() -> bool:
            """No rebalance began since `moment` and no other recovery is due: a seek now cannot land on
            the next recovery's partitions after its own seeks."""
            return (recovery.in_recovery and not recovery.signal_recovery_start.is_set()
                    and (self.app.consumer_generation_id, self.app.rebalancing_count) == moment)

        if not same_recovery():
            self.recovery_stalls.forget()
            return
        recovering: dict[TP, tuple[int, int, int]] = {}
        try:
            for tp in list(recovery.active_tps):
                last, applied = recovery.active_highwaters.get(tp), recovery.active_offsets.get(tp)
                applied = -1 if applied is None else applied
                if last is not None and applied < last:
                    position = await asyncio.wait_for(self.app.consumer.position(tp), SEND_RETRY_MAX_S)
                    recovering[tp] = (applied, last, -1 if position is None else position)
        except Exception as exc:  # noqa: BLE001 - e.g. revoked meanwhile: an exception would end the app
            log.info("recovery progress not read: %s", exc)
            self.recovery_stalls.forget()
            return
        if not same_recovery():
            return
        stuck = self.recovery_stalls.observe(moment[0], recovering)
        try:
            stuck = {tp: offset for tp, offset in stuck.items() if tp in self.app.consumer.assignment()}
            if not stuck or not same_recovery():
                return
            await self.app.consumer.seek_wait(stuck)  # all at once: no rebalance can come in between
        except Exception as exc:  # noqa: BLE001 - e.g. revoked meanwhile: the next owner recovers them
            log.warning("could not read changelog partitions %s again: %s", sorted(tp.partition for tp in stuck), exc)
            return
        for tp, offset in stuck.items():
            self.recovery_stalls.reread(tp)
            metrics.HEALTH_REREADS.labels("changelog").inc()
            log.warning("recovery of %s[%d] applied nothing past offset %d at two checks though every record "
                        "up to %d was fetched (records faust dropped in a rebalance): reading them again",
                        tp.topic, tp.partition, offset - 1, recovering[tp][1])

    async def _ask(self, topic: str, partitions: list[int]) -> dict[int, tuple[int, int]]:
        return await asyncio.get_running_loop().run_in_executor(self._offsets_thread, self._offsets_of, topic,
                                                                partitions)

    def _offsets_of(self, topic: str, partitions: list[int]) -> dict[int, tuple[int, int]]:
        """Each of `partitions` -> (where the group reads it from next, its end), from the broker (blocking)."""
        if self._offsets is None:
            self._offsets = LagReader(self.config.bootstrap)
        positions = self._offsets.positions(self.names.endpoint_health_app, topic, complete=False)
        return {p: positions[p] for p in partitions if p in positions}

    # ------------------------------------------------------------------ metrics
    async def _report(self) -> None:
        self.directory.poll()
        states = Counter(_state(with_health(ep, self.directory.health.get(ep.id)))
                         for ep in self.directory.endpoints.values())
        for state in ("active", "degraded", "disabled"):
            metrics.ENDPOINTS_BY_STATE.labels(state).set(states.get(state, 0))

    # ------------------------------------------------------------------ running
    def ensure_changelog(self) -> None:
        """Create the table's changelog topic before faust starts, and wait until the brokers show it.
        faust would create it itself, but a consumer that subscribes before every broker shows a topic
        just created leaves it out of its metadata until the next refresh (minutes), and the first row
        written meanwhile crashes the agent ("the changelog topic has 0 partitions")."""
        name = self.table.changelog_topic.get_topic_name()
        config = {"cleanup.policy": "compact", **{k: v for k, v in self.attempts_spec.config.items()
                                                  if k == "min.insync.replicas"}}
        spec = TopicSpec(name, self.attempts_spec.partitions, self.attempts_spec.replication_factor, config)
        admin, wait = TopicAdmin(self.config.bootstrap), 0.5
        while True:  # a copy started while the broker is away waits for it, as faust itself would
            try:
                admin.create_missing({name: spec})
                metrics.DEPENDENCY_DOWN.labels("endpoint-health", "kafka").set(0)
                return
            except StackError as exc:  # away, slow or refusing: ask again (a TopicPlanError ends the copy)
                metrics.DEPENDENCY_DOWN.labels("endpoint-health", "kafka").set(1)
                log.warning("changelog topic %s not ready (%s); trying again in %.1f s", name, exc, wait)
                time.sleep(wait)
                wait = min(wait * 2, SEND_RETRY_MAX_S)

    def close(self) -> None:
        self._offsets_thread.shutdown(wait=True)  # no call of the offsets consumer is left running
        if self._offsets is not None:
            self._offsets.close()
        self.directory.close()

    def run(self, banner: str) -> int:
        app = self
        try:
            self.ensure_changelog()
        except BaseException:
            self.close()
            raise

        class Worker(faust.Worker):
            async def on_startup_finished(self) -> None:
                await super().on_startup_finished()
                print(banner, flush=True)

        # The process's log handler stays (logs.setup: its format, tracebacks without exception text): faust's
        # would replace it with its own.
        worker = Worker(self.app, loglevel=self.config.log_level, quiet=True, redirect_stdouts=False,
                        override_logging=False)
        try:
            worker.execute_from_commandline()
        finally:
            app.close()
        return 0


class _App(faust.App):
    """faust's App, starting `while_recovering` (a coroutine function running until the app stops) before
    the first table recovery, which faust's timers wait for."""

    while_recovering: Any = None

    async def on_started(self) -> None:
        if self.while_recovering is not None:
            self.add_future(self.while_recovering())
        await super().on_started()


def _with_offset(h: Health, applied: Health) -> Health:
    """`h` as if it had applied what `applied` did, and nothing else. A row is written when its partition changes
    (one written before rows remembered it, too): an event read again on the same partition is the only one that
    may go unwritten."""
    return replace(h, applied_upto=applied.applied_upto)


def _state(ep: Any) -> str:
    return "disabled" if not ep.enabled else ep.state


def _typed(doc: dict) -> bool:
    """The fields the rules read have the types our writers give them (an event from elsewhere may not)."""
    at_ms, tenant = doc.get("at_ms"), doc.get("tenant_id")
    return ((at_ms is None or isinstance(at_ms, int) and not isinstance(at_ms, bool))
            and (tenant is None or isinstance(tenant, str)))
