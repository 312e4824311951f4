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

import orjson
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition

from . import metrics
from .errors import ConfigError, CostExceedsBurst, GateUnavailable
from .gate import Gate
from .idempotency import ProcessedJobs, StoredRequest, idempotency_key
from .kafka_config import client_config
from .lanes import TopicNames
from .offsets import OffsetTracker
from .providers import RESEND_BATCH_MAX, Outbound, Provider, ProviderCredentials, ProviderResult
from .retry_policy import DeadLetter, RetryAt, RetryPolicy, decide, parse_retry_after
from .send import MalformedEvent, Send, decode
from .yield_policy import Governor, LagReading, YieldPolicy

log = logging.getLogger("streams.worker")
# A 429 asking for at most this long is waited out in the worker (behind the shared cool-down)
# instead of travelling through a retry tier; longer waits go to the tiers.
IN_PROCESS_BACKOFF_MAX_S = 5.0


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
class Pending:
    """One message taken from the lane topic, until its outcome is durable."""

    topic: str
    partition: int
    offset: int
    raw: bytes
    headers: dict[str, bytes]
    send: Send
    attempt: int

    @property
    def where(self) -> Offset:
        return (self.topic, self.partition, self.offset)


@dataclass
class Job:
    key: str
    path: str
    body: bytes
    tenant: str
    send_ids: tuple[str, ...]
    members: list[Pending]   # the messages of ours this request settles
    started: float


Offset = tuple[str, int, int]  # topic, partition, offset


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
        self.pause_reasons: set[str] = set()          # why: "yield", "backpressure"
        self.paused: set[tuple[str, int]] = set()     # which partitions are paused right now
        self.assigned: set[tuple[str, int]] = set()
        self.buffered = 0
        self.running = True
        self.rng = random.Random()
        self._label = (config.channel, config.lane)
        self.governor = Governor(config.yield_policy) if config.yield_policy else None
        self._lag_follower = None
        self._lag_reader = None
        self._next_direct_read = 0.0
        if self.governor:
            self._lag_follower = Consumer(client_config(config.bootstrap, quiet=True, **{
                "group.id": f"{self.group}.lag-follower", "enable.auto.commit": False}))
            self._lag_follower.assign([TopicPartition(names.lag, 0, OFFSET_BEGINNING)])

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
        self._follow_lag()
        self._dispatch()
        self.producer.poll(0)
        self._store_offsets()
        self._backpressure()
        self._apply_pauses()

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
        if self._lag_follower is not None:
            self._lag_follower.close()
        if self._lag_reader is not None:
            self._lag_reader.close()
        self.pool.shutdown(wait=True)
        self.provider.close()

    def _drain(self) -> None:
        """Wait for every provider request in flight and make its outcome durable."""
        while self.in_flight:
            self._collect(block=True)
        self.producer.flush(30)

    # ------------------------------------------------------------------ rebalance
    def _on_assign(self, consumer, partitions) -> None:
        self.assigned |= {(p.topic, p.partition) for p in partitions}
        # Pauses are per partition and a new assignment starts unpaused: re-apply the desired state.
        if self.pause_reasons and partitions:
            consumer.pause(partitions)
            self.paused |= {(p.topic, p.partition) for p in partitions}
        self._pause_metrics()

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
        self.assigned -= gone
        self.paused -= gone
        self._pause_metrics()

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
        if "yield" in self.pause_reasons:
            return  # yield, do not drain: what is in flight finishes, nothing new starts
        if self.governor is not None and self.governor.reading is None:
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
        wait = None
        if result.outcome in ("throttled", "quota"):
            metrics.PROVIDER_429.labels(prov, result.error_name or result.outcome).inc()
            wait = parse_retry_after(result.retry_after, now_ms) or 1.0
            # Every worker holds off the provider, not only the one that saw the 429.
            self.gate.cool_down(prov, wait)
        if result.outcome == "unknown":
            self.jobs.keep_unknown(job.key)
        else:
            self.jobs.release(job.send_ids, job.key)
        if result.outcome == "throttled" and wait <= IN_PROCESS_BACKOFF_MAX_S:
            self._back_off_in_process(job, result, now_ms)
            return
        for p in job.members:
            decision = decide(self.policies[p.send.policy], p.attempt, p.send.created_at_ms, result,
                              now_ms, self.rng.random())
            if isinstance(decision, RetryAt):
                self._retry(p, decision, result, now_ms)
            elif isinstance(decision, DeadLetter):
                self._dead_letter(p, decision.reason, result, now_ms)
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
                self._dead_letter(p, decision.reason, result, now_ms)
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
            metrics.END_TO_END.labels(*self._label).observe(max(0, now_ms - p.send.created_at_ms) / 1000)
            events.append(self._outcome(p.send, "delivered", p.attempt, now_ms, ids.get(p.send.send_id, "")))
        for send_id in job.send_ids:
            if send_id not in held:  # recovered request: a send whose message another consumer holds
                events.append({"send_id": send_id, "tenant_id": job.tenant, "channel": self.cfg.channel,
                               "lane": self.cfg.lane, "status": "delivered", "attempts": None,
                               "provider": self.cfg.provider_name, "provider_message_id": ids.get(send_id, ""),
                               "reason": "", "completed_at_ms": now_ms})
        remaining = [len(events)]

        def acked() -> None:
            remaining[0] -= 1
            if remaining[0] == 0:
                self.jobs.mark_delivered(job.send_ids, job.key)
                for p in job.members:
                    self.tracker.finish(*p.where)

        metrics.SENDS.labels(*self._label, "delivered").inc(len(held))
        for event in events:
            self._produce(self.cfg.names.outcomes, event["send_id"].encode(), orjson.dumps(event), {}, acked)

    def _outcome(self, s: Send, status: str, attempts: int, now_ms: int, provider_message_id: str = "",
                 reason: str = "") -> dict:
        return {"send_id": s.send_id, "tenant_id": s.tenant_id, "channel": s.channel, "lane": s.lane,
                "status": status, "attempts": attempts, "provider": self.cfg.provider_name,
                "provider_message_id": provider_message_id, "reason": reason,
                "created_at_ms": s.created_at_ms, "completed_at_ms": now_ms,
                "latency_ms": max(0, now_ms - s.created_at_ms)}

    def _error_header(self, result: ProviderResult) -> bytes:
        return f"{result.status or result.outcome} {result.error_name} {result.error_body}".strip().encode()[:1000]

    def _retry(self, p: Pending, decision: RetryAt, result: ProviderResult, now_ms: int) -> None:
        headers = {**p.headers, "send_id": p.send.send_id.encode(), "tenant": p.send.tenant_id.encode(),
                   "lane": p.send.lane.encode(), "policy": p.send.policy.encode(),
                   "attempt": str(p.attempt + 1).encode(), "due_at_ms": str(decision.due_ms).encode(),
                   "tier": decision.tier.encode(), "retry_reason": decision.reason.encode(),
                   "origin_topic": self.topic.encode(), "last_error": self._error_header(result)}
        headers.setdefault("first_error", headers["last_error"])
        topic = self.cfg.names.retry(self.cfg.channel, self.cfg.lane, decision.tier)
        metrics.RETRIES.labels(*self._label, decision.tier).inc()
        metrics.SENDS.labels(*self._label, "retry").inc()
        self._produce(topic, p.send.tenant_id.encode(), p.raw, headers, self._finisher(p.where))

    def _dead_letter(self, p: Pending, reason: str, result: ProviderResult | None, now_ms: int) -> None:
        headers = {**p.headers, "send_id": p.send.send_id.encode(), "tenant": p.send.tenant_id.encode(),
                   "channel": p.send.channel.encode(), "lane": p.send.lane.encode(),
                   "reason": reason.encode(), "attempts": str(p.attempt).encode(),
                   "origin_topic": headers_origin(p, self.topic), "group": self.group.encode(),
                   "dead_lettered_at_ms": str(now_ms).encode()}
        headers.setdefault("origin_partition", str(p.partition).encode())
        headers.setdefault("origin_offset", str(p.offset).encode())
        if result is not None:
            headers["last_error"] = self._error_header(result)
            headers.setdefault("first_error", headers["last_error"])
        metrics.DLQ.labels(*self._label, reason).inc()
        metrics.SENDS.labels(*self._label, "dead_lettered").inc()
        self._produce(self.cfg.names.dlq, p.send.send_id.encode(), p.raw, headers, self._finisher(p.where))
        event = self._outcome(p.send, "dead_lettered", p.attempt, now_ms, reason=reason)
        self._produce(self.cfg.names.outcomes, p.send.send_id.encode(), orjson.dumps(event), {}, None)

    def _dead_letter_raw(self, msg, headers: dict[str, bytes], reason: str, detail: str) -> None:
        """An event that never became a send: dead-letter it with the reason; the partition moves on."""
        log.warning("dead-lettering %s[%d]@%d: %s (%s)", msg.topic(), msg.partition(), msg.offset(),
                    reason, detail[:200])
        send_id = headers.get("send_id") or _peek_send_id(msg.value())
        dlq_headers = {**headers, "send_id": send_id, "reason": reason.encode(),
                       "detail": detail.encode()[:1000], "channel": self.cfg.channel.encode(),
                       "lane": self.cfg.lane.encode(), "origin_topic": msg.topic().encode(),
                       "origin_partition": str(msg.partition()).encode(),
                       "origin_offset": str(msg.offset()).encode(), "group": self.group.encode(),
                       "dead_lettered_at_ms": str(int(time.time() * 1000)).encode()}
        metrics.DLQ.labels(*self._label, reason).inc()
        where = (msg.topic(), msg.partition(), msg.offset())
        self._produce(self.cfg.names.dlq, send_id or None, msg.value(), dlq_headers, self._finisher(where))

    def _finisher(self, where: Offset):
        return lambda: self.tracker.finish(*where)

    def _finish_duplicate(self, p: Pending) -> None:
        metrics.DUPLICATES.labels(*self._label).inc()
        self.tracker.finish(*p.where)

    def _produce(self, topic: str, key: bytes | None, value: bytes | None, headers: dict,
                 on_ack=None) -> None:
        """Produce; `on_ack` runs (on the poll thread) once the broker has acknowledged the record."""
        def on_delivery(err, _msg) -> None:
            if err is not None:
                # Not acknowledged: the offset stays unfinished, so the message is processed again.
                log.error("could not write to %s: %s; the message will be processed again", topic, err)
                return
            if on_ack is not None:
                on_ack()

        while True:
            try:
                self.producer.produce(topic, key=key, value=value, headers=list(headers.items()),
                                      on_delivery=on_delivery)
                return
            except BufferError:
                self.producer.poll(0.1)  # local queue full: let deliveries drain

    # ------------------------------------------------------------------ offsets and back-pressure
    def _store_offsets(self) -> None:
        offsets = [TopicPartition(t, p, o) for (t, p), o in self.tracker.committable().items()
                   if (t, p) in self.assigned]
        if offsets:
            try:
                self.consumer.store_offsets(offsets=offsets)
            except Exception as exc:  # noqa: BLE001 - a partition revoked meanwhile (_STATE)
                log.debug("store_offsets: %s", exc)
        metrics.BUFFERED.labels(*self._label).set(self.buffered)

    def _backpressure(self) -> None:
        """Bounded memory: pause every partition while the tenant queues are full."""
        if self.buffered >= self.cfg.max_buffered:
            self.pause_reasons.add("backpressure")
        elif self.buffered <= self.cfg.max_buffered // 2:
            self.pause_reasons.discard("backpressure")

    def _follow_lag(self) -> None:
        """Marketing: follow the transactional lane's lag and yield above the threshold."""
        if self.governor is None:
            return
        key = f"{self.cfg.channel}.transactional".encode()
        for msg in self._lag_follower.consume(num_messages=100, timeout=0):
            if msg.error() or msg.key() != key or not msg.value():
                continue
            try:
                doc = orjson.loads(msg.value())
                self.governor.observe(LagReading(int(doc["lag_messages"]), float(doc["lag_seconds"]), int(doc["ts"])))
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                log.warning("ignoring an unreadable lag reading at %s@%d", msg.topic(), msg.offset())
        now_ms = int(time.time() * 1000)
        stale = self.governor.stale(now_ms)
        if stale and time.monotonic() >= self._next_direct_read:
            # The monitor is silent: measure the lag ourselves rather than run blind or stall.
            self._next_direct_read = time.monotonic() + 1.0
            try:
                if self._lag_reader is None:
                    from .lag import LagReader
                    self._lag_reader = LagReader(self.cfg.bootstrap)
                names = self.cfg.names
                self.governor.observe(self._lag_reader.read(names.group(self.cfg.channel, "transactional"),
                                                            names.lane(self.cfg.channel, "transactional"),
                                                            source="direct"))
            except Exception as exc:  # noqa: BLE001 - keep the last decision until a reading arrives
                log.warning("direct lag read failed: %s", exc)
        metrics.LAG_READING_STALE.labels(self.cfg.channel).set(1 if stale else 0)
        if self.governor.reading is not None:
            metrics.LAG_READING_AGE.labels(self.cfg.channel).set((now_ms - self.governor.reading.ts_ms) / 1000)
        if self.governor.decide(now_ms):
            if "yield" not in self.pause_reasons:
                log.info("transactional lag %d: marketing yields", self.governor.reading.lag_messages)
            self.pause_reasons.add("yield")
        elif "yield" in self.pause_reasons:
            log.info("transactional lag %d: marketing resumes", self.governor.reading.lag_messages)
            self.pause_reasons.discard("yield")

    def _apply_pauses(self) -> None:
        """Make the partitions' paused state match the reasons. The consumer keeps polling while
        paused (heartbeats, rebalances, max.poll.interval)."""
        if self.pause_reasons:
            todo = self.assigned - self.paused
            if todo:
                self.consumer.pause([TopicPartition(t, p) for t, p in todo])
                self.paused |= todo
        elif self.paused:
            self.consumer.resume([TopicPartition(t, p) for t, p in self.paused])
            self.paused = set()
        self._pause_metrics()

    def _pause_metrics(self) -> None:
        for reason in ("yield", "backpressure"):
            metrics.PAUSED.labels(*self._label, reason).set(1 if reason in self.pause_reasons else 0)
        metrics.PAUSED_PARTITIONS.labels(*self._label).set(len(self.paused & self.assigned))
        metrics.ASSIGNED_PARTITIONS.labels(*self._label).set(len(self.assigned))


def headers_origin(p: Pending, topic: str) -> bytes:
    return p.headers.get("origin_topic", topic.encode())


def _peek_send_id(value: bytes | None) -> bytes:
    try:
        doc = orjson.loads(value or b"")
        return str(doc.get("send_id", "")).encode() if isinstance(doc, dict) else b""
    except orjson.JSONDecodeError:
        return b""

