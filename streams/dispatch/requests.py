"""Turning queued messages into provider requests: processed_jobs, the gate, the claim, the call.

For each ready tenant queue: take up to one request's worth of messages (a batch only where the
provider's batch endpoint serves this lane), skip sends already delivered, re-send a request
whose outcome is unknown byte for byte under its own key, ask the gate for both buckets, claim
the fresh sends with the exact request body, and hand the HTTP call to the thread pool.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from .. import metrics
from ..backoff import Outage
from ..errors import ConfigError, CostExceedsBurst, StoreUnavailable
from ..gate.gate import Gate
from ..gate.token_bucket import Limit
from ..providers.http import Provider
from ..providers.outcome import Outbound
from ..providers.registry import ProviderCredentials, ProviderSpec
from ..retry.policy import RetryPolicy, expired
from .idempotency import REFRESH_EVERY_S, ProcessedJobs, StoredRequest, idempotency_key
from .tenant_queues import Pending, TenantQueues, unique_sends

log = logging.getLogger("streams.dispatch")
CLAIM_RACE_ROUNDS = 3  # sends claimed meanwhile by a racing worker drop out of the request
LIMITS_TTL_S = 10.0
COOL_DOWN_JITTER = 0.2  # workers leave a shared 429 cool-down up to 20% after it ends, not all at once


@dataclass
class Job:
    """A provider request in flight and the messages of ours it settles."""

    key: str
    path: str
    body: bytes
    tenant: str
    send_ids: tuple[str, ...]
    members: list[Pending]
    queue: str = ""  # the tenant queue (the endpoint's, for webhooks) it was taken from


class Dispatcher:
    """Every Redis call happens before the messages involved are handed on (started, skipped or
    queued again): when Redis fails mid-way, the messages taken for the request go back to the front
    of their queue and the dispatcher holds, with backoff, until Redis answers."""

    def __init__(self, spec: ProviderSpec, lane: str, worker_id: str, concurrency: int, queues: TenantQueues,
                 jobs: ProcessedJobs, gate: Gate, provider: Provider, credentials: ProviderCredentials,
                 on_duplicate: Callable[[Pending], None], redis_outage: Outage,
                 policies: dict[str, RetryPolicy], on_expired: Callable[[Pending], None]):
        self.spec, self.lane, self.worker_id = spec, lane, worker_id
        self.batches = lane in spec.batch_lanes
        self.reserve = lane == "marketing"  # marketing may not take the transactional reserve
        self.concurrency = concurrency
        self.queues, self.jobs, self.gate = queues, jobs, gate
        self.provider, self.credentials = provider, credentials
        self.on_duplicate = on_duplicate
        self.outage = redis_outage
        self.policies = policies
        self.on_expired = on_expired
        self.in_flight: dict[Future, Job] = {}
        self._limits: dict[str, tuple[float, Limit]] = {}  # tenant -> (read at, limit)
        self.rng = random.Random()
        self.per_queue: int | None = None  # requests in flight per queue (per webhook endpoint); None: one per step
        self.in_flight_by_queue: Counter[str] = Counter()
        # A queue whose requests fail gets one request in flight until one succeeds again, then earns
        # its share back one by one: a failing webhook endpoint never holds many of the worker's slots.
        self.queue_caps: dict[str, int] = {}
        self._open: dict[int, Pending] = {}  # taken for the current request, not yet handed on
        self._next_refresh = 0.0

    def dispatch(self) -> None:
        """Start requests for ready tenants, in random order (no tenant is always first in line)."""
        if not self.outage.ready(time.monotonic()):
            return
        ready = self.queues.ready(time.monotonic())
        self.rng.shuffle(ready)
        for key in ready:
            if len(self.in_flight) >= self.concurrency or time.monotonic() < self.queues.global_ready_at:
                return
            try:
                self._dispatch_queue(key)
                while self.per_queue is not None and self._room(key):
                    self._dispatch_queue(key)
            except StoreUnavailable as exc:
                self.outage.failed(time.monotonic(), exc)
                return
            except ConfigError as exc:
                log.error("%s; holding tenant %s", exc, self.queues.head_tenant(key))
                self.queues.hold(key, time.monotonic() + 5.0)
        if ready:
            self.outage.recovered(time.monotonic())

    def _cap(self, key: str) -> int:
        return self.queue_caps.get(key, self.per_queue or 1)

    def _room(self, key: str) -> bool:
        """Whether another request of this queue may start now (its own cap, the worker's, its hold)."""
        return (self.queues.size(key) > 0 and self.queues.queues[key].ready_at <= time.monotonic()
                and len(self.in_flight) < self.concurrency and self.in_flight_by_queue[key] < self._cap(key))

    def done(self, job: Job, succeeded: bool) -> None:
        """A request finished: its queue may start another, and earns or loses its share of slots."""
        self.in_flight_by_queue[job.queue] -= 1
        if self.in_flight_by_queue[job.queue] <= 0:
            del self.in_flight_by_queue[job.queue]
        if self.per_queue is not None:
            if succeeded:
                cap = self._cap(job.queue) + 1
                if cap >= self.per_queue:
                    self.queue_caps.pop(job.queue, None)
                else:
                    self.queue_caps[job.queue] = cap
            else:
                self.queue_caps[job.queue] = 1

    def tenant_limit(self, tenant: str) -> Limit:
        """The tenant's bucket limit, read from Redis at most every LIMITS_TTL_S (operators change it)."""
        cached = self._limits.get(tenant)
        now = time.monotonic()
        if cached is None or now - cached[0] > LIMITS_TTL_S:
            cached = (now, self.gate.tenant_limit(self.spec.name, tenant))
            self._limits[tenant] = cached
        return cached[1]

    def per_request(self, tenant: str) -> int:
        """Messages per provider request: a batch (up to the tenant's burst) where this lane batches."""
        if not self.batches:
            return 1
        return min(self.spec.batch_max, self.tenant_limit(tenant).burst)

    def _dispatch_queue(self, key: str) -> None:
        if self.per_queue is not None and self.in_flight_by_queue[key] >= self._cap(key):
            return  # this endpoint has its share of requests in flight
        tenant = self.queues.head_tenant(key)  # the queue key, except in the FIFO baseline
        taken = self.queues.take(key, self.per_request(tenant))
        self._open = {id(p): p for p in taken}
        try:
            self._dispatch_taken(key, tenant, taken)
        except (StoreUnavailable, ConfigError):
            self.queues.put_back(key, [p for p in taken if id(p) in self._open])
            raise
        finally:
            self._open = {}

    def _dispatch_taken(self, key: str, tenant: str, taken: list[Pending]) -> None:
        self.credentials.for_tenant(tenant)  # no API key: ConfigError before anything is claimed
        now_ms = int(time.time() * 1000)
        for p in [p for p in taken if expired(self.policies[p.send.policy], p.send.created_at_ms, now_ms)]:
            self._open.pop(id(p), None)  # the age is checked before every attempt: never sent too late
            self.on_expired(p)
        items, duplicates = unique_sends([p for p in taken if id(p) in self._open])
        states = self.jobs.status(tenant, [p.send.send_id for p in items])
        fresh: list[Pending] = []
        unknown: dict[str, list[Pending]] = {}
        for p, state in zip(items, states, strict=True):
            if state in ("delivered", "reconcile"):
                duplicates.append(p)
            elif state is None:
                fresh.append(p)
            else:
                unknown.setdefault(state.removeprefix("inflight:"), []).append(p)
        for p in duplicates:
            self._skip(p)
        waiting = [p for request_key, group in unknown.items()
                   if not self._recover(request_key, tenant, group, key) for p in group]
        if waiting:  # another worker holds their request right now: look again shortly
            self._requeue(key, waiting, hold_until=time.monotonic() + 1.0)
        if fresh and self._admit(key, tenant, fresh):
            self._submit(key, tenant, fresh)

    # ---- hand-offs: every message taken ends in exactly one of these
    def _skip(self, p: Pending) -> None:
        self._open.pop(id(p), None)
        self.on_duplicate(p)

    def _requeue(self, key: str, items: list[Pending], hold_until: float | None = None) -> None:
        for p in items:
            self._open.pop(id(p), None)
        self.queues.put_back(key, items, hold_until=hold_until)

    def _start(self, job: Job) -> None:
        api_key = self.credentials.for_tenant(job.tenant)
        for p in job.members:
            self._open.pop(id(p), None)
        fut = self.provider.submit(job.path, job.body, api_key, job.key)
        self.in_flight[fut] = job
        self.in_flight_by_queue[job.queue] += 1

    # ---- the steps
    def _admit(self, key: str, tenant: str, fresh: list[Pending]) -> bool:
        """Both buckets, or put the messages back and hold whichever bucket was short."""
        try:
            admission = self.gate.acquire(self.spec.name, tenant, len(fresh), reserve=self.reserve)
        except CostExceedsBurst:
            self._limits.pop(tenant, None)  # limits changed: learn the burst again
            self._requeue(key, fresh)
            return False
        if admission.allowed:
            return True
        metrics.GATE_DENIALS.labels(self.spec.name, self.lane, admission.short).inc()
        metrics.GATE_WAIT.labels(self.spec.name, self.lane).observe(admission.wait_s)
        wait_s = admission.wait_s
        if admission.short == "cooldown":  # everyone sees the same cool-down: end it at a jittered moment
            wait_s *= 1 + COOL_DOWN_JITTER * self.rng.random()
        until = time.monotonic() + wait_s
        self._requeue(key, fresh, hold_until=until if admission.short == "tenant" else None)
        if admission.short != "tenant":
            self.queues.hold_all(until)
        return False

    def _submit(self, key: str, tenant: str, fresh: list[Pending]) -> None:
        for _ in range(CLAIM_RACE_ROUNDS):
            ids = [p.send.send_id for p in fresh]
            request_key = idempotency_key(ids)
            path, body = self.provider.build(
                [Outbound(p.send.send_id, tenant, p.send.lane, p.send.payload) for p in fresh], batch=self.batches)
            busy = set(self.jobs.claim(ids, request_key, self.worker_id, path, body, tenant))
            if not busy:
                self._start(Job(request_key, path, body, tenant, tuple(sorted(ids)), fresh, key))
                return
            self._requeue(key, [fresh[i] for i in sorted(busy)], hold_until=time.monotonic() + 0.5)
            fresh = [p for i, p in enumerate(fresh) if i not in busy]
            if not fresh:
                return
        self._requeue(key, fresh)

    def _recover(self, request_key: str, tenant: str, group: list[Pending], queue: str) -> bool:
        """An earlier request carrying these sends has no known outcome. Re-send it, byte for byte,
        under its own idempotency key, once its sender's lease has lapsed. False: still held."""
        stored: StoredRequest | None = self.jobs.take_over(tenant, request_key, self.worker_id)
        if stored is None:
            return False
        try:
            admission = self.gate.acquire(self.spec.name, stored.tenant, len(stored.send_ids), reserve=self.reserve)
        except CostExceedsBurst:
            # Stored before the tenant's burst was lowered: it cannot be split (same body, same key),
            # so it is charged a full burst instead of never being admitted.
            burst = self.gate.tenant_limit(self.spec.name, stored.tenant).burst
            admission = self.gate.acquire(self.spec.name, stored.tenant, burst, reserve=self.reserve)
        if not admission.allowed:
            self.jobs.keep_unknown(tenant, request_key)
            return False
        # Other messages of ours that belong to the same request settle with it.
        members = group + self.queues.splice(queue, stored.send_ids)
        self._start(Job(request_key, stored.path, stored.body, stored.tenant, stored.send_ids, members, queue))
        log.info("re-sending request %s (%d sends) after an unknown outcome", request_key, len(stored.send_ids))
        return True

    def refresh_leases(self) -> None:
        """Keep the leases of our requests in flight alive (at most every REFRESH_EVERY_S): while we
        live, nobody takes them over; if we die, they lapse within the lease and are taken over."""
        now = time.monotonic()
        if now < self._next_refresh or not self.in_flight:
            return
        self._next_refresh = now + REFRESH_EVERY_S
        try:
            self.jobs.refresh([(job.tenant, job.key) for job in self.in_flight.values()], self.worker_id)
        except StoreUnavailable as exc:
            self.outage.failed(now, exc)

    def close(self) -> None:
        """Nothing of its own to release: the provider owns the requests' threads or event loop."""
