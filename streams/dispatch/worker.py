"""The lane worker: `streams worker --channel email --lane marketing` (run as many copies as needed).

One consumer group per lane topic. Messages are queued per tenant, so a tenant whose bucket is
empty waits alone while other tenants sharing its partitions keep moving; offsets are stored only
up to the lowest unfinished message of each partition, and only after its outcome is durable
(delivered and marked in processed_jobs, or handed to a retry topic / the DLQ with the broker's ack).

All Kafka and Redis calls happen on the poll thread; a small thread pool only waits on provider
HTTP requests. The consumer and producer are built by the caller (`streams.runtime`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaError, Producer

from .. import metrics
from ..backoff import Outage
from ..errors import ConfigError, PublishError, StackError, StoreUnavailable
from ..gate.gate import Gate
from ..kafka_client import assign_in_callback, commit_now, consume_ready, store_offsets
from ..lag.yield_policy import YieldPolicy
from ..lanes import RETRY_TIERS
from ..names import TopicNames
from ..offsets import OffsetTracker
from ..providers.outcome import ProviderResult
from ..providers.registry import ProviderSpec
from ..retry.policy import RetryPolicy, tier_at_least
from ..send import Send
from ..state.guard import StateGuard
from .backlog import BacklogShare
from .idempotency import LEASE_S, REFRESH_EVERY_S, ProcessedJobs
from .intake import Admitted, Rejected, admit
from .pauses import LanePauses
from .records import RecordWriter
from .requests import Dispatcher, Job, by_state
from .routes import Routes
from .settle import Settler
from .stages import wall_ms
from .tenant_queues import Pending, TenantQueues, by_tenant

TRIM_EVERY_S = 1.0  # how often queues grown past their tenant's share are trimmed

log = logging.getLogger("streams.worker")


@dataclass(frozen=True)
class WorkerConfig:
    channel: str
    lane: str
    bootstrap: str
    provider: ProviderSpec          # the channel's first provider (its name labels the lane's records)
    names: TopicNames = TopicNames()
    concurrency: int = 8            # provider requests in flight
    max_buffered: int = 20_000      # messages held in tenant queues before partitions are paused
    max_buffered_bytes: int = 256 * 2**20  # ... or bytes of them (a queued message takes ~2x its size in memory)
    lease_s: float = LEASE_S        # a claim's lease; refreshed every REFRESH_EVERY_S while in flight
    yield_policy: YieldPolicy | None = None  # marketing lanes yield to the transactional lane
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")

    def __post_init__(self) -> None:
        if self.lease_s < 3 * REFRESH_EVERY_S:
            raise ConfigError(f"a claim lease of {self.lease_s} s would lapse between two refreshes "
                              f"(every {REFRESH_EVERY_S} s) of a live worker's requests")

    @property
    def topic(self) -> str:
        return self.names.lane(self.channel, self.lane)

    @property
    def group(self) -> str:
        return self.names.group(self.channel, self.lane)


class LaneWorker:
    def __init__(self, config: WorkerConfig, consumer: Consumer, producer: Producer, routes: Routes,
                 gate: Gate, jobs: ProcessedJobs,
                 policies: dict[str, RetryPolicy], queue_key: Callable[[Send], str] = by_tenant,
                 guard: StateGuard | None = None, backlog: BacklogShare | None = None,
                 on_gone: Callable[[Job, ProviderResult], bool] | None = None):
        """`backlog` (a share of the buffer per tenant, the excess parked on a retry tier) is on in
        every production worker; only the benchmarks' naive baseline runs without it."""
        self.cfg = config
        self.topic, self.group = config.topic, config.group
        self.consumer, self.producer, self.routes = consumer, producer, routes
        self.jobs, self.gate = jobs, gate
        self.policies = policies
        self.queues = TenantQueues(queue_key, owned=lambda partition: partition in self.pauses.assigned)
        self.tracker = OffsetTracker()
        self.pauses = LanePauses(consumer, config.bootstrap, config.names, config.channel, config.lane,
                                 config.yield_policy)
        self._label = (config.channel, config.lane)
        records = RecordWriter(producer, config.names, config.channel, config.lane, config.provider.name,
                               self.topic, self.group)
        self.records = records
        self.redis_outage = Outage("Redis (dispatch)")
        self.consume_outage = Outage("Kafka (consume)")
        self.settler = Settler(routes, self._label, self.queues, self.tracker, jobs, gate,
                               records, policies, self.redis_outage, config.worker_id, on_gone)
        self.dispatcher = Dispatcher(routes, config.lane, config.worker_id, config.concurrency,
                                     self.queues, jobs, gate, self._finish_duplicate,
                                     self.redis_outage, policies, self.settler.dead_letter_too_old,
                                     self.settler.dead_letter_unbuildable, self.settler.dead_letter_unknown_outcome,
                                     on_state_lost=guard.recheck if guard is not None else lambda: None,
                                     on_stale=self._finish_stale, hold_long=self.settler.hold_long)
        self._redis_down = metrics.DEPENDENCY_DOWN.labels(f"worker.{config.channel}.{config.lane}", "redis")
        self.guard = guard
        self.backlog = backlog
        self.trim_every_s = TRIM_EVERY_S
        self._next_trim = 0.0
        # A poll returned messages not tracked yet: offsets stored meanwhile (a revoke served in the consume that
        # follows the poll, a shutdown after that consume raised) stop at what is tracked (`store_offsets`).
        self._untracked = False
        self._held = False  # the last step held dispatch back (see `_idle_timeout`)
        self.running = True

    # ------------------------------------------------------------------ lifecycle
    def stop(self, *_: object) -> None:
        self.running = False

    def run(self, until: Callable[[], bool] | None = None) -> None:
        """Poll until stop() (SIGTERM/SIGINT) or `until()` is true; then finish in-flight work,
        commit and leave the group."""
        self.consumer.subscribe([self.topic], on_assign=self._on_assign, on_revoke=self._on_revoke,
                                on_lost=self._on_lost)
        try:
            while self.running and not (until and until()):
                self.step()
        finally:
            self.shutdown()

    def step(self) -> None:
        # First: before anything reads the sends of claims this worker made and never sent (an expired message
        # parked at intake ends by reading them), or they read as its own request in flight.
        self.dispatcher.release_unsent_claims()
        msgs = self._of_assigned(consume_ready(self.consumer, 500, self._idle_timeout(), self._returned))
        # The whole batch is tracked before any of it is taken in: should taking one in fail (the worker
        # then stops), the offsets stored on the way out stay below the messages not yet taken in.
        for msg in msgs:
            if not msg.error():
                self.tracker.add(msg.topic(), msg.partition(), msg.offset())
        self._untracked = False
        for msg in msgs:
            self._intake(msg)
        self._trim()
        self._collect()
        self.settler.spill_long_holds(self._end_expired)
        self.dispatcher.refresh_leases()
        self.settler.retry()
        self.pauses.follow_lag()
        # Yield, do not drain: what is in flight finishes, nothing new starts. Without any lag
        # reading yet (monitor or direct), a yielding lane does not run blind. With Redis's data
        # lost, nothing is dispatched until an operator recovers it.
        self._poll_adapters()
        self.gate.refresh_cool_downs()
        self._held = (self.pauses.yielding or self.pauses.without_reading or not self.routes.primary.adapter.ready
                      or not self._state_intact())
        if not self._held:
            self.dispatcher.dispatch()
        else:
            self._probe_redis()
        self.records.writer.poll(0)
        self.settler.flush_marks()
        self._redis_down.set(1 if self.redis_outage.active else 0)
        self._store_offsets()
        # What waits for the broker's acknowledgement counts too: with a retry tier, the DLQ or the outcomes
        # unwritable (an ACL, a partition without its replicas) the copies pile up there, not in the queues.
        self.pauses.backpressure(self.queues.buffered + self.records.writer.pending, self.cfg.max_buffered,
                                 self.queues.buffered_bytes + self.records.writer.pending_bytes,
                                 self.cfg.max_buffered_bytes)
        self.pauses.apply()

    def _of_assigned(self, msgs: list) -> list:
        """Drop a message whose partition was revoked after the poll returned it (the revoke runs in the next
        consume of the same batch): its new owner reads it again, and tracking it here would bring back the
        partition's offsets, below what the new owner commits, should the partition come back."""
        assigned = self.pauses.assigned
        return [m for m in msgs if m.error() or (m.topic(), m.partition()) in assigned]

    def _end_expired(self, items: list[Pending]) -> list[Pending]:
        """`Dispatcher.end_expired`, only while Redis's data is intact: with it lost, every send would read as
        never tried (a delivered one dead-lettered `too_old`); they are all kept, as by a Redis outage."""
        return self.dispatcher.end_expired(items) if self._state_intact() else items

    def _probe_redis(self) -> None:
        """A held worker (yielding, say) asks Redis nothing: an outage it met would stay reported
        (`dispatch_dependency_down`) for as long as the hold lasts. It asks once per back-off instead."""
        now = time.monotonic()
        if not (self.redis_outage.active and self.redis_outage.ready(now)):
            return
        try:
            self.jobs.ping()
        except StoreUnavailable as exc:
            self.redis_outage.failed(now, exc)
        else:
            self.redis_outage.recovered(now)

    def _state_intact(self) -> bool:
        if self.guard is None:
            return True
        try:
            return self.guard.check()
        except (StoreUnavailable, StackError, PublishError) as exc:
            self.redis_outage.failed(time.monotonic(), exc)
            return False

    def _idle_timeout(self) -> float:
        """How long the consumer may block. A new message ends the wait at once; a provider's answer
        and the broker's acknowledgement of an outcome record cannot, so while either is awaited the
        wait is a millisecond: an answer is settled, and an acknowledged send marked and its offset
        stored, within about a millisecond, and a message that arrives meanwhile is taken at once
        (an earlier version waited up to 10 ms on the provider's futures alone, and a lone OTP
        arriving then waited with them). Otherwise until the next tenant (or the provider) becomes
        ready, and Redis may be tried again after a failure, at most 0.2 s. While dispatch is held
        (yielding, no lag reading, the provider's adapter catching up, Redis's data lost) no queue's
        readiness counts: the wait is a step's whole 0.2 s (0.01 s for the adapter, which catches up
        on this thread), not a busy loop for as long as the hold lasts. Records and settlements that
        wait out a backoff (the broker or Redis failing) end the wait when it is over, not before."""
        writer, settler = self.records.writer, self.settler
        if self.dispatcher.in_flight or writer.awaiting or (settler.pending and settler.outage.ready(time.monotonic())):
            return 0.001
        now = time.monotonic()
        backoffs = [t for t in (writer.next_try_at, settler.outage.next_try_at if settler.pending else None)
                    if t is not None]
        if self._held:
            wait = 0.2 if self.routes.primary.adapter.ready else 0.01
            return max(0.0, min([wait, *(t - now for t in backoffs)]))
        next_ready = self.queues.next_ready(now, self.dispatcher.paced_until)
        if next_ready is not None and self.redis_outage.active:
            next_ready = max(next_ready, self.redis_outage.next_try_at)
        return max(0.0, min([0.2, *(t - now for t in backoffs),
                               *((next_ready - now,) if next_ready is not None else ())]))

    def _returned(self) -> None:
        self._untracked = True

    def shutdown(self) -> None:
        self._drain()
        self._store_offsets(past_idle_to_position=not self._untracked)
        commit_now(self.consumer)
        self.consumer.close()
        self.pauses.close()
        self.dispatcher.close()

    def _drain(self, timeout_s: float = 30.0, partitions: set[tuple[str, int]] | None = None) -> None:
        """Wait for every provider request in flight (of `partitions` only: those holding a message of one) and make
        its outcome durable (within `timeout_s` for Redis and the broker: what is still unsettled then is read again
        later)."""
        def waited_for(job: Job) -> bool:
            return partitions is None or any((p.topic, p.partition) in partitions for p in job.members)

        while any(waited_for(job) for job in self.dispatcher.in_flight.values()):
            self._collect(block=True)
        deadline = time.monotonic() + timeout_s
        while self._settling(partitions) and time.monotonic() < deadline:
            self.records.writer.poll(0.1)  # acknowledgements finish offsets (after the marks below)
            self.settler.flush_marks()
            self.settler.retry()
            if self.dispatcher.in_flight:  # the kept partitions' requests (a revoke): their leases stay alive
                self._poll_adapters()
                self.dispatcher.refresh_leases()

    def _settling(self, partitions: set[tuple[str, int]] | None) -> bool:
        """Whether outcomes are still being made durable: any at all, or (`partitions`) those of messages of these
        partitions taken into a request or a record. A message still queued is not waited for (its partition's new
        owner reads it), nor is another partition's outcome: a revoke during a Redis outage does not wait it out for
        partitions with nothing to settle."""
        if not (self.settler.pending or self.records.writer.pending):
            return False  # nothing left that could finish a message (one never taken in, after a step failed)
        if partitions is None:
            return True
        unfinished = {tp: n for tp in partitions if (n := self.tracker.unfinished(*tp))}
        if not unfinished:
            return False
        queued = Counter(tp for q in self.queues.queues.values() for p in q.items
                         if (tp := (p.topic, p.partition)) in unfinished)
        return any(n > queued[tp] for tp, n in unfinished.items())

    # ------------------------------------------------------------------ rebalance
    def _on_assign(self, consumer, partitions) -> None:
        # A new assignment starts unpaused: re-apply the desired pause state to it (assigned first, or the pause of a
        # new consumer's partitions would not hold).
        metrics.REBALANCES.labels(*self._label, "assigned").inc(len(partitions))
        assign_in_callback(consumer, partitions)
        self.pauses.on_assign(partitions)

    def _on_revoke(self, consumer, partitions) -> None:
        metrics.REBALANCES.labels(*self._label, "revoked").inc(len(partitions))
        # Only the revoked partitions' requests are waited for (cooperative rebalancing: the others stay here, and
        # their requests, a provider's slow answer say, do not hold the whole group's rebalance).
        self._drain(partitions={(p.topic, p.partition) for p in partitions})
        # Served inside the consume after a poll, the consumer's position is past a message that poll returned
        # and that is not tracked yet (it is dropped: its new owner reads it): store what is tracked, not beyond.
        self._store_offsets(past_idle_to_position=not self._untracked)
        commit_now(consumer)
        self._forget(partitions)

    def _on_lost(self, consumer, partitions) -> None:
        metrics.REBALANCES.labels(*self._label, "lost").inc(len(partitions))
        self._forget(partitions)

    def _forget(self, partitions) -> None:
        gone = {(p.topic, p.partition) for p in partitions}
        self.queues.forget(gone)
        for tp in gone:
            self.tracker.forget(*tp)
        self.pauses.forget(gone)

    # ------------------------------------------------------------------ intake and outcomes
    def _intake(self, msg) -> None:
        if msg.error():
            if msg.error().code() != KafkaError._PARTITION_EOF:
                self.consume_outage.failed(time.monotonic(), msg.error())  # librdkafka reconnects by itself
            return
        if self.consume_outage.active:
            self.consume_outage.recovered(time.monotonic())
        try:
            headers = dict(msg.headers() or [])
        except (UnicodeDecodeError, ValueError, TypeError):  # a header name that is not UTF-8
            headers = {}
            verdict: Admitted | Rejected = Rejected("malformed", "a header name is not UTF-8")
        else:
            verdict = admit(msg.value(), headers, self.cfg.channel, self.cfg.lane, self.policies)
        if isinstance(verdict, Rejected):
            finish = self.settler.finisher((msg.topic(), msg.partition(), msg.offset()))
            if verdict.send is None or self._carried_on_elsewhere(verdict.send, headers):
                self.records.dead_letter_raw(msg, headers, verdict.reason, verdict.detail, finish)
            else:  # a send: its status says so too (else it reads `accepted` for 30 days), with where its letter is
                refused = Pending(msg.topic(), msg.partition(), msg.offset(), msg.value(), headers, verdict.send, 1,
                                  "", wall_ms())
                self.records.dead_letter(refused, verdict.reason, None, int(time.time() * 1000), finish,
                                         detail=verdict.detail)
            return
        p = Pending(msg.topic(), msg.partition(), msg.offset(), msg.value(), headers, verdict.send, verdict.attempt,
                    (headers.get("provider") or b"").decode(errors="replace"), wall_ms(), declined=verdict.declined)
        if not self._parked(p):
            self.queues.add(p)

    def _carried_on_elsewhere(self, send: Send, headers: dict[str, bytes]) -> bool:
        """Whether a send this worker refuses may be carried on by another (a worker of another version, during a
        rollout): by processed_jobs, this copy would not be sent here either (delivered, a later attempt made, a
        claim, left to reconciliation), or its state cannot be read. Its dead letter then leaves its status alone:
        a final `dead_lettered` would let a replay send it while its chain may still deliver it. A copy that
        would be sent (nothing else carries it on) gets its outcome event."""
        if not self.dispatcher.outage.ready(time.monotonic()):
            return True
        try:
            [[state]] = self.dispatcher.jobs.status_many([(send.tenant_id, [send.send_id])])
        except StoreUnavailable:
            return True
        try:
            attempt = int(headers.get("attempt") or b"1")
        except ValueError:
            attempt = 1
        return by_state(state, attempt, too_old=False) != "send"

    def _parked(self, p: Pending) -> bool:
        """Park a message whose tenant already holds its share of the buffer on a retry tier, due
        back about when its turn comes; the partition (and its committed offset) moves on. Redis is
        asked for the tenant's limit (at most every 10 s) only while the dispatch's Redis back-off allows."""
        if self.backlog is None:
            return False
        now = time.monotonic()
        if not self.redis_outage.ready(now):
            return False  # no limit to plan with: kept (backpressure bounds memory; `_trim` parks it later)
        tenant = p.send.tenant_id
        key = self.queues.key_of(p)
        route = self.routes.of(p.provider)
        try:
            limit = self.dispatcher.tenant_limit(route, tenant)
            paced, rate, burst = self.dispatcher.drain(key, tenant, limit.rate, self._burst_left(key, limit.burst, now))
            held_s = self._held_for(key, now)
            wait_s = self.backlog.park(paced, self._queued(key, paced, tenant, p.provider), rate,
                                       self.dispatcher.per_request(route, tenant), now, burst, held=held_s > 0)
        except StoreUnavailable as exc:
            self.redis_outage.failed(now, exc)
            return False
        except ConfigError:
            return False
        if wait_s is None:
            return False
        now_ms = int(time.time() * 1000)
        due_ms = now_ms + int(max(wait_s, held_s) * 1000)  # back in turn, and not before its queue's hold ends
        policy = self.settler.policies.get(p.send.policy)
        if policy is not None and due_ms > (deadline_ms := p.send.created_at_ms + policy.max_age_s * 1000):
            # Never parked past its max age: a tier keeps a copy only so long (its retention), and a send whose
            # turn comes after it could not be sent then anyway. Parked until it, at most; one that comes back
            # still behind its turn, its max age (all but) reached, ends as it would before an attempt.
            if deadline_ms - now_ms < min(RETRY_TIERS.values()) * 1000:
                return not self._end_expired([p])  # not ended (Redis down): kept
            due_ms = deadline_ms
        self.backlog.parked(paced, now + (due_ms - now_ms) / 1000)
        self.records.spill(p, due_ms, tier_at_least((due_ms - now_ms) / 1000), self.settler.finisher(p.where))
        return True

    def _queued(self, key: str, paced: str, tenant: str, provider: str) -> int:
        """What a tenant's share of the buffer is measured against: all it holds for this provider, over every
        queue of it (a webhook tenant's endpoints: each holding a whole share, thirty of them filled the buffer and
        paused every partition); a queue paced apart (a failing endpoint's), what that queue holds."""
        return self.queues.size(key) if paced == key else self.queues.of_bucket[(tenant, provider)]

    def _held_for(self, key: str, now: float) -> float:
        """Seconds left of the hold a queue is under (0: none)."""
        q = self.queues.queues.get(key)
        return max(0.0, q.ready_at - now) if q is not None else 0.0

    def _burst_left(self, key: str, burst: int, now: float) -> int:
        """What the tenant's bucket may let go at once: its burst, or nothing while its queue waits on a hold or its
        bucket is dry (the gate holds a tenant's queue until its next token, or a minute at most, once its bucket ran
        dry)."""
        q = self.queues.queues.get(key)
        return 0 if q is not None and max(q.ready_at, q.dry_until) > now else burst

    def _trim(self) -> None:
        """Park what a queue holds past its tenant's share, once a second: what was kept while the tenant's limit
        could not be read (Redis down), or before its limit was lowered. Intake checks only what arrives; left
        in place, such a queue would hold the worker's buffer full (every tenant paused with it) and its
        partition's committed offset back until the tenant's own rate had worked through it."""
        now = time.monotonic()
        if self.backlog is None or now < self._next_trim or not self.redis_outage.ready(now):
            return
        self._next_trim = now + self.trim_every_s
        for key in [k for k, q in self.queues.queues.items() if q.items]:
            route, tenant = self.routes.of(self.queues.head_provider(key)), self.queues.head_tenant(key)
            try:
                limit = self.dispatcher.tenant_limit(route, tenant)
                per_request = self.dispatcher.per_request(route, tenant)
                paced, rate, burst = self.dispatcher.drain(key, tenant, limit.rate,
                                                           self._burst_left(key, limit.burst, now))
                past_share = self.backlog.excess(self._queued(key, paced, tenant, self.queues.head_provider(key)),
                                                 self.queues.size(key), rate, per_request, burst,
                                                 held=self._held_for(key, now) > 0)
            except StoreUnavailable as exc:
                self.redis_outage.failed(now, exc)
                return
            except ConfigError:
                continue
            excess = self.queues.take_newest(key, past_share)
            for i, p in enumerate(excess):
                if not self._parked(p):  # its turn is near after all (or Redis failed): the rest stays queued
                    for kept in excess[i:]:
                        self.queues.add(kept)
                    break

    def _collect(self, block: bool = False) -> None:
        in_flight, finished = self.dispatcher.in_flight, self.dispatcher.finished
        if block and not finished and in_flight:
            # Wait for the next answer (a rebalance or a shutdown drains here), keeping our leases alive
            # meanwhile (a lapsed lease would let another worker send the same request), and what the
            # adapters follow: a webhook delivery to an endpoint the view has not read yet waits for it.
            wait_futures(list(in_flight), timeout=0.05, return_when=FIRST_COMPLETED)
            self._poll_adapters()
            self.dispatcher.refresh_leases()
        done = []
        while finished:
            fut = finished.popleft()
            if fut in in_flight:
                done.append(fut)
        for fut in done:
            job = in_flight.pop(fut)
            try:
                result = fut.result()
            except Exception as exc:  # noqa: BLE001 - a bug in an adapter must not lose the sends
                # Its text may name a recipient or a webhook URL (a credential, for some receivers): the line names
                # its class, and the log's formatter shows the traceback without that text (logs.TEXT_SHOWN).
                log.error("provider call failed unexpectedly (%s)", type(exc).__name__, exc_info=exc)
                result = ProviderResult("unknown", error_name=type(exc).__name__)
            job.stamps["answered"] = wall_ms()
            self.dispatcher.done(job, succeeded=result.outcome in ("delivered", "skipped"), latency_s=result.latency_s)
            provider = self.routes.of(job.provider).name
            metrics.PROVIDER_REQUESTS.labels(provider, result.outcome).inc()
            metrics.PROVIDER_LATENCY.labels(provider).observe(result.latency_s)
            self.settler.settle(job, result)

    def _poll_adapters(self) -> None:
        for route in self.routes.order:
            route.adapter.poll()

    def _finish_duplicate(self, p: Pending) -> None:
        metrics.DUPLICATES.labels(*self._label).inc()
        self.tracker.finish(*p.where)

    def _finish_stale(self, p: Pending) -> None:
        metrics.STALE_COPIES.labels(*self._label).inc()
        log.info("skipped a stale copy of send %s: its attempt %d was made already", p.send.send_id, p.attempt)
        self.tracker.finish(*p.where)

    def _store_offsets(self, past_idle_to_position: bool = True) -> None:
        store_offsets(self.consumer, self.tracker, self.pauses.assigned, past_idle_to_position)
        metrics.BUFFERED.labels(*self._label).set(self.queues.buffered)
