"""The lane worker: `streams worker --channel email --lane marketing` (run as many copies as needed).

One consumer group per lane topic. Messages are queued per tenant, so a tenant whose bucket is
empty waits alone while other tenants sharing its partitions keep moving; offsets are stored only
up to the lowest unfinished message of each partition, and only after its outcome is durable
(delivered and marked in processed_jobs, or handed to a retry topic / the DLQ with the broker's ack).

All Kafka and Redis calls happen on the poll thread; a small thread pool only waits on provider
HTTP requests. Marketing email always goes through the batch endpoint (<= 100 per request, one
tenant per request); transactional sends go one per request.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from . import metrics
from .errors import ConfigError, CostExceedsBurst, GateUnavailable
from .gate import Gate
from .idempotency import ProcessedJobs, StoredRequest, idempotency_key
from .kafka_config import client_config
from .lane_pauses import LanePauses
from .lanes import TopicNames
from .offsets import OffsetTracker
from .pending import Offset, Pending
from .providers import RESEND_BATCH_MAX, Outbound, Provider, ProviderCredentials, ProviderResult
from .records import RecordWriter
from .retry_policy import DeadLetter, RetryAt, RetryPolicy, cool_down_s, decide, wait_in_process
from .send import MalformedEvent, decode
from .yield_policy import YieldPolicy

log = logging.getLogger("streams.worker")


@dataclass(frozen=True)
class WorkerConfig:
    channel: str
    lane: str
    bootstrap: str
    names: TopicNames = TopicNames()
    concurrency: int = 8            # provider requests in flight
    max_buffered: int = 20_000      # messages held in tenant queues before partitions are paused
    lease_s: float = 30.0           # must exceed the provider timeout
    yield_policy: YieldPolicy | None = None  # marketing lanes yield to the transactional lane
    fifo: bool = False  # benchmark baseline only: one queue for every tenant (the naive design)
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")

    @property
    def provider_name(self) -> str:
        return {"email": "resend", "sms": "sms"}.get(self.channel, self.channel)

    @property
    def batches(self) -> bool:
        """Email blasts travel only through the batch endpoint."""
        return self.channel == "email" and self.lane == "marketing"


@dataclass
class Job:
    key: str
    path: str
    body: bytes
    tenant: str
    send_ids: tuple[str, ...]
    members: list[Pending]   # the messages of ours this request settles
    started: float


@dataclass
class TenantQueue:
    items: deque = field(default_factory=deque)
    ready_at: float = 0.0


def _headers(msg) -> dict[str, bytes]:
    return {k: v for k, v in (msg.headers() or [])}


class LaneWorker:
    def __init__(self, config: WorkerConfig, provider: Provider, gate: Gate, jobs: ProcessedJobs,
                 credentials: ProviderCredentials, policies: dict[str, RetryPolicy],
                 consumer_overrides: dict | None = None):
        self.cfg = config
        self.provider = provider
        self.gate = gate
        self.jobs = jobs
        self.credentials = credentials
        self.policies = policies
        names = config.names
        self.topic = names.lane(config.channel, config.lane)
        self.group = names.group(config.channel, config.lane)
        self.consumer = Consumer(client_config(config.bootstrap, **{
            "group.id": self.group,
            # Rebalances move only the partitions that change owner; the rest keep flowing.
            "partition.assignment.strategy": "cooperative-sticky",
            # At-least-once: offsets are stored by this code after the outcome is durable, and
            # auto-commit only ever commits what was stored.
            "enable.auto.offset.store": False,
            "enable.auto.commit": True,
            "auto.commit.interval.ms": 1000,
            "auto.offset.reset": "earliest",
            "session.timeout.ms": 10_000,
            "heartbeat.interval.ms": 1_000,
            **(consumer_overrides or {}),
        }))
        self.producer = Producer(client_config(config.bootstrap, **{
            # Retry/DLQ/outcome records are written once, in order, and acknowledged by all ISRs.
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 5,
        }))
        self.pool = ThreadPoolExecutor(max_workers=config.concurrency, thread_name_prefix="provider")
        self.tenants: dict[str, TenantQueue] = {}
        self.tracker = OffsetTracker()
        self.in_flight: dict[Future, Job] = {}
        self.global_ready_at = 0.0
        self.tenant_batch_cap: dict[str, int] = {}
        self.pauses = LanePauses(self.consumer, config.bootstrap, names, config.channel, config.lane,
                                 self.group, config.yield_policy)
        self.records = RecordWriter(self.producer, names, config.channel, config.lane, config.provider_name,
                                    self.topic, self.group)
        self.buffered = 0
        self.running = True
        self.rng = random.Random()
        self._label = (config.channel, config.lane)
        self._end_to_end = metrics.END_TO_END.labels(*self._label)  # observed per delivered message

    # ------------------------------------------------------------------ lifecycle
    def stop(self, *_: object) -> None:
        self.running = False

    def run(self, until=None) -> None:
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
        msgs = self.consumer.consume(num_messages=500, timeout=self._idle_timeout())
        for msg in msgs:
            self._intake(msg)
        if self.in_flight and not msgs:
            # Wake as soon as a provider request completes rather than on the next poll.
            wait_futures(list(self.in_flight), timeout=0.01, return_when=FIRST_COMPLETED)
        self._collect()
        self.pauses.follow_lag()
        self._dispatch()
        self.producer.poll(0)
        self._store_offsets()
        self.pauses.backpressure(self.buffered, self.cfg.max_buffered)
        self.pauses.apply()

    def _idle_timeout(self) -> float:
        """How long consume() may block: not at all while requests are in flight or a tenant is
        ready, otherwise until the next tenant (or the provider) becomes ready, at most 0.2 s."""
        if self.in_flight:
            return 0.0
        now = time.monotonic()
        waits = [q.ready_at for q in self.tenants.values() if q.items]
        if not waits:
            return 0.2
        next_ready = max(min(waits), self.global_ready_at)
        return min(0.2, max(0.0, next_ready - now))

    def shutdown(self) -> None:
        self._drain()
        self._store_offsets()
        try:
            self.consumer.commit(asynchronous=False)
        except Exception as exc:  # noqa: BLE001 - nothing stored yet is not an error
            log.debug("final commit: %s", exc)
        self.consumer.close()
        self.pauses.close()
        self.pool.shutdown(wait=True)
        self.provider.close()

    def _drain(self) -> None:
        """Wait for every provider request in flight and make its outcome durable."""
        while self.in_flight:
            self._collect(block=True)
        self.producer.flush(30)

    # ------------------------------------------------------------------ rebalance
    def _on_assign(self, consumer, partitions) -> None:
        # A new assignment starts unpaused: re-apply the desired pause state to it.
        self.pauses.on_assign(partitions)

    def _on_revoke(self, consumer, partitions) -> None:
        self._drain()
        self._store_offsets()
        revoked = [TopicPartition(p.topic, p.partition) for p in partitions]
        try:
            consumer.commit(asynchronous=False)
        except Exception as exc:  # noqa: BLE001 - e.g. nothing to commit
            log.debug("commit on revoke: %s", exc)
        self._forget(revoked)

    def _on_lost(self, consumer, partitions) -> None:
        self._forget(partitions)

    def _forget(self, partitions) -> None:
        gone = {(p.topic, p.partition) for p in partitions}
        for q in self.tenants.values():
            kept = deque(p for p in q.items if (p.topic, p.partition) not in gone)
            self.buffered -= len(q.items) - len(kept)
            q.items = kept
        for tp in gone:
            self.tracker.forget(*tp)
        self.pauses.forget(gone)

    # ------------------------------------------------------------------ intake
    def _intake(self, msg) -> None:
        if msg.error():
            if msg.error().code() != KafkaError._PARTITION_EOF:
                log.warning("consume error on %s: %s", self.topic, msg.error())
            return
        self.tracker.add(msg.topic(), msg.partition(), msg.offset())
        headers = _headers(msg)
        try:
            send = decode(msg.value())
        except MalformedEvent as exc:
            self._dead_letter_raw(msg, headers, exc.reason, exc.detail)
            return
        if send.channel != self.cfg.channel:
            self._dead_letter_raw(msg, headers, "channel_mismatch",
                                  f"a {send.channel} send on the {self.cfg.channel} lane topic")
            return
        if self.cfg.lane == "transactional" and send.lane == "marketing":
            self._dead_letter_raw(msg, headers, "lane_violation",
                                  f"a {send.category} send may not travel in the transactional lane")
            return
        if send.policy not in self.policies:
            self._dead_letter_raw(msg, headers, "unknown_policy", f"no retry policy named {send.policy!r}")
            return
        attempt = int(headers.get("attempt", b"1"))
        pending = Pending(msg.topic(), msg.partition(), msg.offset(), msg.value(), headers, send, attempt)
        queue_key = "*" if self.cfg.fifo else send.tenant_id
        self.tenants.setdefault(queue_key, TenantQueue()).items.append(pending)
        self.buffered += 1

    # ------------------------------------------------------------------ dispatch
    def _ready_tenants(self) -> list[str]:
        now = time.monotonic()
        if now < self.global_ready_at:
            return []
        return [t for t, q in self.tenants.items() if q.items and q.ready_at <= now]

    def _batch_cap(self, tenant: str) -> int:
        if not self.cfg.batches:
            return 1
        cap = self.tenant_batch_cap.get(tenant)
        if cap is None:
            cap = min(RESEND_BATCH_MAX, self.gate.tenant_burst(self.cfg.provider_name, tenant))
            self.tenant_batch_cap[tenant] = cap
        return cap

    def _dispatch(self) -> None:
        if self.pauses.yielding:
            return  # yield, do not drain: what is in flight finishes, nothing new starts
        if self.pauses.without_reading:
            return  # no lag reading yet (monitor or direct): do not run blind
        ready = self._ready_tenants()
        self.rng.shuffle(ready)  # no tenant is always first in line
        for tenant in ready:
            if len(self.in_flight) >= self.cfg.concurrency or time.monotonic() < self.global_ready_at:
                return
            try:
                self._dispatch_tenant(tenant, self.tenants[tenant])
            except GateUnavailable as exc:
                log.error("%s; holding sends until Redis answers", exc)
                self.global_ready_at = time.monotonic() + 1.0
                return
            except ConfigError as exc:
                log.error("%s; holding tenant %s", exc, tenant)
                self.tenants[tenant].ready_at = time.monotonic() + 5.0

    def _take(self, q: TenantQueue, n: int) -> list[Pending]:
        """Up to n messages from the head of a queue, all of one tenant (one API key per request)."""
        tenant = q.items[0].send.tenant_id
        taken = []
        while q.items and len(taken) < n and q.items[0].send.tenant_id == tenant:
            taken.append(q.items.popleft())
        self.buffered -= len(taken)
        return taken

    def _put_back(self, q: TenantQueue, items: list[Pending]) -> None:
        q.items.extendleft(reversed(items))
        self.buffered += len(items)

    def _dispatch_tenant(self, queue_key: str, q: TenantQueue) -> None:
        tenant = q.items[0].send.tenant_id  # the queue key, except in the FIFO baseline
        items = self._take(q, self._batch_cap(tenant))
        # Deduplicate within the request itself (a duplicate job in the same poll).
        unique: dict[str, Pending] = {}
        for p in items:
            if p.send.send_id in unique:
                self._finish_duplicate(p)
            else:
                unique[p.send.send_id] = p
        items = list(unique.values())
        states = self.jobs.status([p.send.send_id for p in items])
        fresh: list[Pending] = []
        unknown: dict[str, list[Pending]] = {}
        for p, state in zip(items, states):
            if state == "delivered":
                self._finish_duplicate(p)
            elif state is None:
                fresh.append(p)
            else:
                unknown.setdefault(state.removeprefix("inflight:"), []).append(p)
        waiting: list[Pending] = []
        for key, group in unknown.items():
            if not self._recover(key, group, q):
                waiting.extend(group)
        if waiting:
            # Another worker holds their request right now: look again shortly.
            self._put_back(q, waiting)
            q.ready_at = time.monotonic() + 1.0
        if not fresh:
            return
        try:
            admission = self.gate.acquire(self.cfg.provider_name, tenant, len(fresh),
                                          reserve=self.cfg.lane == "marketing")
        except CostExceedsBurst:
            self.tenant_batch_cap.pop(tenant, None)  # limits changed: learn the burst again
            self._put_back(q, fresh)
            return
        if not admission.allowed:
            metrics.GATE_DENIALS.labels(self.cfg.provider_name, self.cfg.lane, admission.short).inc()
            metrics.GATE_WAIT.labels(self.cfg.provider_name, self.cfg.lane).observe(admission.wait_s)
            self._put_back(q, fresh)
            until = time.monotonic() + admission.wait_s
            if admission.short == "tenant":
                q.ready_at = until
            else:
                self.global_ready_at = until
            return
        self._submit_fresh(tenant, q, fresh)

    def _submit_fresh(self, tenant: str, q: TenantQueue, fresh: list[Pending]) -> None:
        for _ in range(3):  # sends claimed meanwhile by a racing worker drop out of the request
            ids = [p.send.send_id for p in fresh]
            key = idempotency_key(ids)
            path, body = self.provider.build(
                [Outbound(p.send.send_id, tenant, p.send.lane, p.send.payload) for p in fresh],
                batch=self.cfg.batches)
            busy = self.jobs.claim(ids, key, self.cfg.worker_id, path, body, tenant)
            if not busy:
                self._start(Job(key, path, body, tenant, tuple(sorted(ids)), fresh, time.monotonic()))
                return
            taken = [fresh[i] for i in busy]
            self._put_back(q, taken)
            q.ready_at = time.monotonic() + 0.5
            fresh = [p for i, p in enumerate(fresh) if i not in set(busy)]
            if not fresh:
                return
        self._put_back(q, fresh)

    def _recover(self, key: str, group: list[Pending], q: TenantQueue) -> bool:
        """An earlier request carrying these sends has no known outcome. Re-send it, byte for byte,
        under its own idempotency key, once its sender's lease has lapsed. False: still held."""
        stored: StoredRequest | None = self.jobs.take_over(key, self.cfg.worker_id)
        if stored is None:
            return False
        admission = self.gate.acquire(self.cfg.provider_name, stored.tenant, len(stored.send_ids),
                                      reserve=self.cfg.lane == "marketing")
        if not admission.allowed:
            self.jobs.keep_unknown(key)
            return False
        # Other messages of ours that belong to the same request settle with it.
        queued = [p for p in q.items if p.send.send_id in stored.send_ids]
        q.items = deque(p for p in q.items if p.send.send_id not in stored.send_ids)
        self.buffered -= len(queued)
        members = group + queued
        self._start(Job(key, stored.path, stored.body, stored.tenant, stored.send_ids, members,
                        time.monotonic()))
        log.info("re-sending request %s (%d sends) after an unknown outcome", key, len(stored.send_ids))
        return True

    def _start(self, job: Job) -> None:
        api_key = self.credentials.for_tenant(job.tenant)
        fut = self.pool.submit(self.provider.post, job.path, job.body, api_key, job.key)
        self.in_flight[fut] = job

    # ------------------------------------------------------------------ outcomes
    def _collect(self, block: bool = False) -> None:
        done = [f for f in self.in_flight if f.done()]
        if block and not done and self.in_flight:
            next(iter(self.in_flight)).result()
            done = [f for f in self.in_flight if f.done()]
        for fut in done:
            job = self.in_flight.pop(fut)
            try:
                result = fut.result()
            except Exception as exc:  # noqa: BLE001 - a bug in an adapter must not lose the sends
                log.exception("provider call failed unexpectedly")
                result = ProviderResult("unknown", error_name=type(exc).__name__)
            self._settle(job, result)

    def _settle(self, job: Job, result: ProviderResult) -> None:
        prov = self.cfg.provider_name
        metrics.PROVIDER_REQUESTS.labels(prov, result.outcome).inc()
        metrics.PROVIDER_LATENCY.labels(prov).observe(result.latency_s)
        now_ms = int(time.time() * 1000)
        if result.outcome == "delivered":
            self._settle_delivered(job, result, now_ms)
            return
        wait = cool_down_s(result, now_ms)
        if wait is not None:
            metrics.PROVIDER_429.labels(prov, result.error_name or result.outcome).inc()
            # Every worker holds off the provider, not only the one that saw the 429.
            self.gate.cool_down(prov, wait)
        if result.outcome == "unknown":
            self.jobs.keep_unknown(job.key)
        else:
            self.jobs.release(job.send_ids, job.key)
        if wait_in_process(result, now_ms):
            self._back_off_in_process(job, result, now_ms)
            return
        for p in job.members:
            decision = decide(self.policies[p.send.policy], p.attempt, p.send.created_at_ms, result,
                              now_ms, self.rng.random())
            if isinstance(decision, RetryAt):
                self.records.retry(p, decision, result, self._finisher(p.where))
            elif isinstance(decision, DeadLetter):
                self.records.dead_letter(p, decision.reason, result, now_ms, self._finisher(p.where))
            else:  # Delivered cannot follow a failed result
                raise AssertionError(decision)

    def _back_off_in_process(self, job: Job, result: ProviderResult, now_ms: int) -> None:
        """A short 429: the request was not accepted, so its sends go back to the front of their
        tenant queue (the shared cool-down holds every worker off until Retry-After). The attempt
        counts; a send out of attempts is handled by its policy as usual."""
        q = self.tenants.setdefault(job.tenant, TenantQueue())
        again = []
        for p in job.members:
            decision = decide(self.policies[p.send.policy], p.attempt, p.send.created_at_ms, result,
                              now_ms, self.rng.random())
            if isinstance(decision, RetryAt):
                p.attempt += 1
                again.append(p)
            else:
                self.records.dead_letter(p, decision.reason, result, now_ms, self._finisher(p.where))
        if again:
            self._put_back(q, again)
            metrics.SENDS.labels(*self._label, "throttled_in_process").inc(len(again))

    def _settle_delivered(self, job: Job, result: ProviderResult, now_ms: int) -> None:
        """Outcome events first, then the `delivered` mark, then the offsets. A crash in between
        leaves the sends in flight: the next worker re-sends the same request under the same key,
        the provider replays its answer, and the outcomes are published again (at least once)."""
        ids = dict(zip(sorted(job.send_ids), result.message_ids))
        events = []
        held = set()
        for p in job.members:
            if p.send.send_id in held:
                continue
            held.add(p.send.send_id)
            self._end_to_end.observe(max(0, now_ms - p.send.created_at_ms) / 1000)
            events.append(self.records.outcome_event(p.send, "delivered", p.attempt, now_ms,
                                                     ids.get(p.send.send_id, "")))
        for send_id in job.send_ids:
            if send_id not in held:  # recovered request: a send whose message another consumer holds
                events.append(self.records.delivered_elsewhere_event(send_id, job.tenant, now_ms,
                                                                     ids.get(send_id, "")))
        remaining = [len(events)]

        def acked() -> None:
            remaining[0] -= 1
            if remaining[0] == 0:
                self.jobs.mark_delivered(job.send_ids, job.key)
                for p in job.members:
                    self.tracker.finish(*p.where)

        metrics.SENDS.labels(*self._label, "delivered").inc(len(held))
        for event in events:
            self.records.outcome(event, acked)

    def _finisher(self, where: Offset):
        return lambda: self.tracker.finish(*where)

    def _dead_letter_raw(self, msg, headers: dict[str, bytes], reason: str, detail: str) -> None:
        self.records.dead_letter_raw(msg, headers, reason, detail,
                                     self._finisher((msg.topic(), msg.partition(), msg.offset())))

    def _finish_duplicate(self, p: Pending) -> None:
        metrics.DUPLICATES.labels(*self._label).inc()
        self.tracker.finish(*p.where)

    # ------------------------------------------------------------------ offsets
    def _store_offsets(self) -> None:
        offsets = [TopicPartition(t, p, o) for (t, p), o in self.tracker.committable().items()
                   if (t, p) in self.pauses.assigned]
        if offsets:
            try:
                self.consumer.store_offsets(offsets=offsets)
            except Exception as exc:  # noqa: BLE001 - a partition revoked meanwhile (_STATE)
                log.debug("store_offsets: %s", exc)
        metrics.BUFFERED.labels(*self._label).set(self.buffered)
