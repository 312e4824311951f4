"""Turning queued messages into provider requests: processed_jobs, the gate, the claim, the call.

For each ready tenant queue: take up to one request's worth of messages (a batch only where the
provider's batch endpoint serves this lane), skip sends already delivered, re-send a request
whose outcome is unknown byte for byte under its own key, ask the gate for both buckets, claim
the fresh sends with the exact request body, and hand the HTTP call to the thread pool.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from .. import metrics
from ..backoff import Outage
from ..errors import BucketUnreadable, ConfigError, CostExceedsBurst, StateLost, StoreUnavailable
from ..gate.gate import Admission, Gate, Unused, give_back
from ..gate.token_bucket import Limit
from ..providers.outcome import Outbound, UnusablePayload
from ..retry.policy import RetryPolicy, expired
from ..stamped import StampedTable
from .growing_holds import GrowingHolds
from .idempotency import RECORD_GONE, REFRESH_EVERY_S, Claim, ProcessedJobs, StoredRequest, idempotency_key
from .routes import Route, Routes
from .stages import wall_ms
from .tenant_queues import Pending, TenantQueues, unique_sends

log = logging.getLogger("streams.dispatch")
CLAIM_RACE_ROUNDS = 3  # sends claimed meanwhile by a racing worker drop out of the request
LIMITS_TTL_S = 10.0
# What a provider adapter raises on a payload it cannot read (a field missing or of the wrong type); a
# ValueError is the adapter refusing the request's shape (a batch too big, a batch where it takes one).
PAYLOAD_ERRORS = (KeyError, TypeError, AttributeError, UnusablePayload)
ROUND_MAX = 256  # requests per dispatch round (each round: three Redis round trips for all of them)
# Workers leave a shared 429 cool-down up to 20% of it after it ends (at most 1 s), not all at once; a share
# of a long cool-down (a Retry-After of an hour) would idle every worker for minutes past its end.
COOL_DOWN_JITTER, COOL_DOWN_JITTER_MAX_S = 0.2, 1.0
# A worker held by a long cool-down asks the gate again within this: an operator who ended it (`streams limits
# clear-cooldown`, once a quota was raised) is heard within seconds, not at the end of the provider's Retry-After.
COOL_DOWN_RECHECK_S = 10.0
# A queue denied by a bucket asks the gate again within this, however long the bucket's own wait (a day at a rate
# of one a day): a limit an operator raises meanwhile reaches what the worker holds within LIMITS_TTL_S of this.
BUCKET_HOLD_MAX_S = 60.0
# A tenant without limits or a provider key waits this long between looks (an operator sets them meanwhile).
MISCONFIGURED_HOLD_S = 30.0


@dataclass
class Draw:
    """Messages taken from one queue for one request, on their way through a dispatch round."""

    key: str
    tenant: str
    items: list[Pending]
    route: Route
    stamps: dict[str, float] = field(default_factory=dict)


@dataclass
class Job:
    """A provider request in flight and the messages of ours it settles."""

    key: str
    path: str
    body: bytes = field(repr=False)  # the provider request: recipients, subject, text
    tenant: str
    send_ids: tuple[str, ...]
    members: list[Pending]
    queue: str = ""  # the tenant queue (the endpoint's, for webhooks) it was taken from
    provider: str = ""  # the provider it went to
    stamps: dict[str, float] = field(default_factory=dict)  # stage timings (dispatch/stages.py)
    # Re-sent after an unknown outcome: the provider may hold the first copy, so no failure of this
    # one may free its sends (they would be re-batched under a new key and delivered twice).
    resent: bool = False


def by_state(state: str | None, attempt: int, too_old: bool) -> str:
    """What a message met before an attempt becomes, by its send's processed_jobs state: "duplicate" (delivered),
    "stale" (its attempt was made and failed, and the copy carrying the send on is durable: sent, this one would
    start a second chain of attempts), "too_old" (never sent late), "unknown_outcome" (the provider may hold it:
    an earlier request's outcome is unknown, or it was left to reconciliation; never sent, never skipped
    unrecorded), "held" (an earlier request holds it: recover it or wait) or "send"."""
    tried = int(state[6:]) if state is not None and state.startswith("tried:") else None
    if state == "delivered":  # first: an old copy of a delivered send is a duplicate, not too old
        return "duplicate"
    if tried is not None and attempt <= tried:
        return "stale"
    if too_old:
        return "too_old" if state is None or tried is not None else "unknown_outcome"
    if state == "reconcile":
        return "unknown_outcome"
    return "send" if state is None or tried is not None else "held"


def _unused(charged: list[tuple[Draw, int]], sent: Counter[int]) -> list[Unused]:
    """What the gate admitted for these draws (`charged`: each with the messages it was admitted for) that did not
    go out: the messages not sent, and the request's own token when none of its messages was."""
    return [Unused(d.route.name, d.tenant, n - sent[id(d)], 0 if sent[id(d)] else 1)
            for d, n in charged if n > sent[id(d)]]


class Dispatcher:
    """Every Redis call happens before the messages involved are handed on (started, skipped or
    queued again): when Redis fails mid-way, the messages taken for the request go back to the front
    of their queue and the dispatcher holds, with backoff, until Redis answers."""

    def __init__(self, routes: Routes, lane: str, worker_id: str, concurrency: int, queues: TenantQueues,
                 jobs: ProcessedJobs, gate: Gate, on_duplicate: Callable[[Pending], None], redis_outage: Outage,
                 policies: dict[str, RetryPolicy], on_expired: Callable[[Pending], None],
                 on_unbuildable: Callable[[Pending, str], None], on_unknown: Callable[[Pending], None],
                 on_state_lost: Callable[[], None] = lambda: None,
                 on_stale: Callable[[Pending], None] | None = None,
                 hold_long: Callable[[str, float, str], None] | None = None):
        self.routes, self.lane, self.worker_id = routes, lane, worker_id
        self.reserve = lane == "marketing"  # marketing may not take the transactional reserve
        self.concurrency = concurrency
        self.queues, self.jobs, self.gate = queues, jobs, gate
        self._misconfigured = GrowingHolds()  # queues without a limit or provider key for their tenant
        # Holds one queue for long, parking what it holds off the partition meanwhile (Settler.hold_long)
        self.hold_long = hold_long or (lambda key, wait, reason: queues.hold(key, time.monotonic() + wait))
        self.on_duplicate = on_duplicate
        self.on_stale = on_stale or on_duplicate  # a copy for an attempt already made and failed
        self.outage = redis_outage
        self.policies = policies
        self.on_expired = on_expired
        self.on_unbuildable = on_unbuildable
        self.on_unknown = on_unknown
        # How a message `by_state` ends without a request is handed on, by its verdict.
        self._enders: dict[str, Callable[[Pending], None]] = {
            "duplicate": on_duplicate, "stale": self.on_stale, "too_old": on_expired, "unknown_outcome": on_unknown}
        self.on_state_lost = on_state_lost
        self.in_flight: dict[Future, Job] = {}
        # Requests that finished, in the order they did (appended by the thread that completed them):
        # the worker settles these without scanning every request in flight on every step.
        self.finished: deque[Future] = deque()
        # (provider, tenant) -> (read at, limit); those read long ago dropped: every tenant ever served
        self._limits: StampedTable[tuple[str, str], Limit] = StampedTable(LIMITS_TTL_S)
        self.rng = random.Random()
        self.per_queue: int | None = None  # requests in flight per queue (per webhook endpoint); None: one per step
        self.in_flight_by_queue: Counter[str] = Counter()
        # Requests in flight per tenant, where queues are endpoints: a tenant's receivers (whose latency
        # it chooses) never hold more than this many of the worker's slots, so other tenants find room.
        self.per_tenant: int | None = None
        self.in_flight_by_tenant: Counter[str] = Counter()
        self._tenant_share: int | None = None  # per_tenant, or less while more tenants have work (`_fair_share`)
        # A queue whose requests fail gets one request in flight until one succeeds again, then earns
        # its share back one by one: a failing webhook endpoint never holds many of the worker's slots.
        self.queue_caps: dict[str, int] = {}
        self.attempt_s: dict[str, float] = {}  # a capped queue's recent attempt time, smoothed (seconds)
        self._open: dict[int, Pending] = {}  # taken for the current request, not yet handed on
        self._claimed: dict[str, Claim] = {}  # asked for in the current round, not yet started (by request key)
        self._unsent_claims: list[Claim] = []  # made, or maybe made (the answer was lost), and never sent
        self._unused_admissions: list[Unused] = []  # what a round cut short by Redis was admitted for and never sent
        self._next_refresh = 0.0
        # The earliest end of a provider's pause between waves that held a ready queue at the last dispatch (0:
        # none): a worker with nothing else to do waits for it rather than spin.
        self.paced_until = 0.0

    def dispatch(self) -> None:
        """Start requests for ready queues, in random order (no tenant is always first in line), in
        rounds: every request of a round reads processed_jobs in one Redis round trip, asks the gate
        in one, and claims in one, instead of three round trips per request."""
        if not self.outage.ready(time.monotonic()) or not self.release_unsent_claims():
            return
        self.routes.refresh_pacing()
        self.paced_until = 0.0
        ready = self.queues.ready(time.monotonic())
        self.rng.shuffle(ready)
        while ready and len(self.in_flight) < self.concurrency:
            draws: list[Draw] = []
            try:
                self._draw(ready, draws)  # reads a tenant's limits from Redis once they are 10 s old
                if not draws:
                    break  # (`paced_until`, when a provider's pause between waves held a ready queue)
                self._run_round(draws)
            except StoreUnavailable as exc:
                for draw in reversed(draws):  # back to the front, in the order they were taken
                    self.queues.put_back(draw.key, [p for p in draw.items if id(p) in self._open])
                self._open = {}
                # Claims asked for and not started are never sent now; with the answer lost, they may be made.
                self._unsent_claims += self._claimed.values()
                self._claimed = {}
                if isinstance(exc, StateLost):
                    self.on_state_lost()  # Redis answers, but empty: the state guard decides what holds
                else:
                    self.outage.failed(time.monotonic(), exc)
                return
            self._open = {}
            now = time.monotonic()
            for route in {id(d.route): d.route for d in draws}.values():
                route.wave_started(now)  # pacing: the next wave to this provider waits its pause
            ready = [k for k in ready if self.per_queue is not None and self._room(k)]
        self.outage.recovered(time.monotonic())

    def release_unsent_claims(self) -> bool:
        """Release the claims this worker made, or may have made (their answer was lost), and never sent; False
        while Redis fails (the worker holds). Run before anything reads those sends again: a round, the end of
        an expired message, a held worker's look at Redis. Left claimed, they would read as another request in
        flight, wait out its lease, and be taken over as possibly sent (no fallback provider; reconciliation at
        a provider without idempotency keys)."""
        if not self._unsent_claims and not self._unused_admissions:
            return True
        if not self.outage.ready(time.monotonic()):
            return False  # asked again once the back-off allows, not on every step
        try:
            if self._unsent_claims:
                self.jobs.release_unsent(self._unsent_claims)
        except StoreUnavailable as exc:
            self.outage.failed(time.monotonic(), exc)
            return False
        self._unsent_claims = []
        # The tenant is charged for what was sent: a blip between the gate and the start of a round's requests
        # (a claim whose answer was lost) would otherwise leave a burst of its tokens spent, a day's quota's too.
        give_back(self.gate, self._unused_admissions)
        self._unused_admissions = []
        return True

    def _draw(self, ready: list[str], draws: list[Draw]) -> None:
        """Requests from the ready queues, one per queue per pass (so tenants take turns), in as many
        passes as the worker's free concurrency allows: a lone tenant's blast fills every free slot in
        one round (three Redis round trips for all of them) as far as its bucket's burst can admit
        them, and each provider's pacing holds. Appends to `draws` as it goes: what it drew before a
        Redis error goes back to its queue."""
        self._tenant_share = self._fair_share(ready)
        drawn: Counter[str] = Counter()
        drawn_of_tenant: Counter[str] = Counter()
        by_route: Counter[str] = Counter()
        by_bucket: Counter[tuple[str, str]] = Counter()  # messages drawn per (provider, tenant) bucket
        size = min(self.concurrency - len(self.in_flight), ROUND_MAX)
        now = time.monotonic()
        while len(draws) < size:
            added = False
            for key in ready:
                if len(draws) >= size:
                    break
                q = self.queues.queues.get(key)
                if not q or not q.items or q.ready_at > now:
                    continue
                if self.per_queue is not None and self.in_flight_by_queue[key] + drawn[key] >= self._cap(key):
                    continue  # this endpoint has its share of requests in flight
                route = self.routes.of(self.queues.head_provider(key))
                if route.room(now) - by_route[route.name] <= 0:
                    if now < route.next_wave_at:
                        self.paced_until = min(self.paced_until or math.inf, route.next_wave_at)
                    continue  # the provider's pacing: enough in flight, or its pause is not over
                tenant = self.queues.head_tenant(key)  # the queue key, except in the FIFO baseline
                if now < route.shared_account_held_until and route.shares_account(tenant):
                    q.ready_at = route.shared_account_held_until  # the account it sends under was refused
                    continue
                if self._tenant_full(tenant, drawn_of_tenant[tenant]):
                    continue  # this tenant's endpoints hold their share of the worker's requests
                try:
                    n, burst = self.per_request(route, tenant), self.tenant_limit(route, tenant).burst
                except ConfigError as exc:
                    self._hold_misconfigured(key, exc)
                    continue
                bucket = (route.name, tenant)
                if by_bucket[bucket] and by_bucket[bucket] + n > burst:
                    # The tenant's bucket holds at most `burst` tokens: the gate would deny a further
                    # request this round, after its processed_jobs read, and it would only go back.
                    continue
                taken = self.queues.take(key, n)
                by_bucket[bucket] += len(taken)
                draws.append(Draw(key, tenant, taken, route, {"dequeued": wall_ms()}))
                self._open.update({id(p): p for p in taken})
                drawn[key] += 1
                drawn_of_tenant[tenant] += 1
                by_route[route.name] += 1
                added = True
            if not added:
                break  # passes repeat while any queue still gave a request: one per queue per pass (fair)

    def _hold_misconfigured(self, key: str, exc: Exception) -> None:
        """A tenant without limits or without a provider key until an operator sets them: its queue waits,
        parked off the partition (which moves on for every other tenant), longer each time, and what outlives
        its max age while it waits is dead-lettered `too_old` as it comes back."""
        wait = self._misconfigured.hold_for(key, MISCONFIGURED_HOLD_S, time.monotonic())
        log.error("%s; holding tenant %s for %.0f s", exc, self.queues.head_tenant(key), wait)
        self.hold_long(key, wait, "misconfigured")

    def _run_round(self, draws: list[Draw]) -> None:
        now_ms = int(time.time() * 1000)
        live: list[Draw] = []
        keyless: list[tuple[Draw, ConfigError]] = []
        for draw in draws:
            try:
                draw.route.credentials.for_tenant(draw.tenant)  # no API key: before anything is claimed
            except ConfigError as exc:
                keyless.append((draw, exc))
                continue
            draw.items, duplicates = unique_sends(draw.items)
            for p in duplicates:
                self._end(p, "duplicate")
            if draw.items:
                live.append(draw)
        for draw, _ in reversed(keyless):  # back to the front, in the order they were taken
            self._requeue(draw.key, draw.items)
        for key, refusal in {draw.key: refusal for draw, refusal in keyless}.items():  # one hold a queue
            self._hold_misconfigured(key, refusal)
        states = self.jobs.status_many([(d.tenant, [p.send.send_id for p in d.items]) for d in live])
        fresh: list[Draw] = []
        for i, (draw, state) in enumerate(zip(live, states, strict=True)):
            # The round's draws start their requests after this: a re-send met on the way leaves them their room.
            if self._sort_by_state(draw, state, now_ms, starting=len(fresh) + len(live) - i - 1):
                fresh.append(draw)
        admitted = self._admit_round(fresh)
        stamp = wall_ms()
        for draw in admitted:
            draw.stamps["admitted"] = stamp
        self._claim_round(admitted)

    def _sort_by_state(self, draw: Draw, states: list[str | None], now_ms: int, starting: int = 0) -> bool:
        """Skip the delivered, dead-letter the too old and those left to reconciliation, recover (or wait
        for) the unknown; keep the fresh in `draw.items`. `starting`: the round's other requests that may start
        after this (a re-send leaves them their room).
        True when fresh messages are left to send."""
        fresh: list[Pending] = []
        unknown: dict[str, list[Pending]] = {}
        for p, state in zip(draw.items, states, strict=True):
            verdict = by_state(state, p.attempt, expired(self.policies[p.send.policy], p.send.created_at_ms, now_ms))
            if verdict == "send":
                fresh.append(p)
            elif verdict == "held":
                unknown.setdefault(state.removeprefix("inflight:"), []).append(p)  # type: ignore[union-attr]
            else:
                self._end(p, verdict)
        starting += 1 if fresh else 0  # this draw's own request
        waiting = [p for request_key, group in unknown.items()
                   if not self._recover(request_key, draw.tenant, group, draw.key, starting) for p in group]
        if waiting:  # another worker holds their request right now: look again shortly
            self._requeue(draw.key, waiting, hold_until=time.monotonic() + 1.0)
        draw.items = fresh
        return bool(fresh)

    def end_expired(self, items: list[Pending]) -> list[Pending]:
        """Messages found past their max age outside a round (a long hold moving off the worker), each ended
        by its send's state as before an attempt: a copy of a delivered send is a duplicate, a stale copy is
        skipped, one the provider may hold is dead-lettered `unknown_outcome`, only the rest `too_old`.
        Returns them all when Redis cannot tell their state (down, or holding off after it failed): the caller
        keeps them (nothing is ended blind)."""
        if not self.outage.ready(time.monotonic()):
            return items
        items, duplicates = unique_sends(items)
        groups: dict[str, list[Pending]] = {}
        for p in items:
            groups.setdefault(p.send.tenant_id, []).append(p)
        try:
            states = self.jobs.status_many([(t, [p.send.send_id for p in g]) for t, g in groups.items()])
        except StoreUnavailable as exc:
            self.outage.failed(time.monotonic(), exc)
            return items + duplicates
        for p in duplicates:
            self._end(p, "duplicate")
        for group, group_states in zip(groups.values(), states, strict=True):
            for p, state in zip(group, group_states, strict=True):
                self._end(p, by_state(state, p.attempt, too_old=True))
        return []

    def _admit_round(self, draws: list[Draw]) -> list[Draw]:
        """Both buckets for every request of the round (one round trip), each at its own provider;
        the denied go back to their queue, holding whichever bucket was short."""
        if not draws:
            return []
        answers = self.gate.acquire_many([(d.route.name, d.tenant, len(d.items), self.reserve) for d in draws])
        admitted = []
        # Last to first: a queue's denied requests go back to its front in the order they were taken.
        for draw, answer in reversed(list(zip(draws, answers, strict=True))):
            if isinstance(answer, CostExceedsBurst):
                self._limits.pop((draw.route.name, draw.tenant), None)  # limits changed: learn the burst again
                self._requeue(draw.key, draw.items)
            elif isinstance(answer, BucketUnreadable):
                # This tenant's buckets unreadable: until an operator mends them, held as a tenant without limits is
                # (`_draw`): parked, never pinning the partition's offset. (No limits at the gate is held briefly
                # below: Redis having lost its data looks the same, for the moment the operator log takes to
                # restore them, and what a lost Redis holds must not be parked where nothing may release it.)
                self._requeue(draw.key, draw.items)
                self._hold_misconfigured(draw.key, answer)
            elif isinstance(answer, Exception):
                self._requeue(draw.key, draw.items, hold_until=time.monotonic() + 5.0)
                log.error("%s; holding tenant %s", answer, draw.tenant)
            elif answer.allowed:
                if (q := self.queues.queues.get(draw.key)) is not None:
                    q.dry_until = 0.0
                self._misconfigured.clear(draw.key)  # its key and limits are there now (the gate's own included)
                admitted.append(draw)
            else:
                self._denied(draw, answer)
        return admitted[::-1]

    def _denied(self, draw: Draw, admission: Admission) -> None:
        metrics.GATE_DENIALS.labels(draw.route.name, self.lane, admission.short).inc()
        metrics.GATE_WAIT.labels(draw.route.name, self.lane).observe(admission.wait_s)
        wait_s = admission.wait_s
        if admission.short == "cooldown" and wait_s > COOL_DOWN_RECHECK_S:
            # Asked again before the last COOL_DOWN_RECHECK_S, which is then left at a jittered moment, as below.
            wait_s = min(COOL_DOWN_RECHECK_S, wait_s - COOL_DOWN_RECHECK_S)
        elif admission.short == "cooldown":  # everyone sees the same cool-down: end it at a jittered moment
            wait_s += min(COOL_DOWN_JITTER * wait_s, COOL_DOWN_JITTER_MAX_S) * self.rng.random()
        else:
            wait_s = min(wait_s, BUCKET_HOLD_MAX_S)
        now = time.monotonic()
        until = now + wait_s
        # A tenant sending under its own provider account has buckets of its own: none of them holds anyone else.
        tenant_only = admission.short == "tenant" or draw.route.credentials.has_own_key(draw.tenant)
        self._requeue(draw.key, draw.items, hold_until=until if tenant_only else None)
        if tenant_only:
            self.queues.queues[draw.key].dry_until = now + admission.wait_s
            return
        # The account every tenant shares (its global bucket, its cool-down): the queues sent under it through this
        # provider wait (`_draw` reads the hold), not those of tenants with accounts of their own, nor another
        # provider's (a fallback's, or the first provider's when a fallback's bucket is dry).
        draw.route.shared_account_held_until = max(draw.route.shared_account_held_until, until)

    def _claim_round(self, draws: list[Draw]) -> None:
        """Claim every admitted request with its exact body (one round trip) and start it; a request
        some of whose sends a racing worker claimed meanwhile is claimed again without them. What the
        gate admitted for sends that did not go out (a request the adapter refuses, a payload it cannot
        read, sends a racing worker claimed) is given back, so the tenant is charged for what was sent."""
        if not draws:
            return
        charged = [(d, len(d.items)) for d in draws]
        sent: Counter[int] = Counter()
        try:
            self._claim_and_start(draws, sent)
        except StoreUnavailable:
            # Given back once Redis answers again (`release_unsent_claims`, before the next round).
            self._unused_admissions += _unused(charged, sent)
            raise
        give_back(self.gate, _unused(charged, sent))

    def _claim_and_start(self, draws: list[Draw], sent: Counter[int]) -> None:
        """Counts the messages started per draw (by `id`) in `sent`, as they start."""
        built: list[Draw] = []
        claims: list[Claim] = []
        held: list[tuple[Draw, str]] = []
        for d in draws:
            claim = self._buildable_claim(d, held)
            if claim is not None:
                claims.append(claim)
                built.append(d)
        for d, why in reversed(held):  # back to the front, in the order they were taken
            log.error("the %s adapter cannot build a request for tenant %s (%s); holding the queue", d.route.name,
                      d.tenant, why)
            self._requeue(d.key, d.items, hold_until=time.monotonic() + 5.0)
        draws = built
        if not draws:
            return
        answers = self._claim_many(claims)
        stamp = wall_ms()
        for draw, claim, busy in zip(draws, claims, answers, strict=True):
            if not busy:
                self._start(draw.route, Job(claim.key, claim.path, claim.body, draw.tenant,
                                            tuple(sorted(claim.send_ids)), draw.items, draw.key, claim.provider,
                                            {**draw.stamps, "claimed": stamp}))
                sent[id(draw)] = len(draw.items)
                continue
            taken = set(busy)
            self._requeue(draw.key, [draw.items[i] for i in sorted(taken)], hold_until=time.monotonic() + 0.5)
            rest = [p for i, p in enumerate(draw.items) if i not in taken]
            if rest:
                sent[id(draw)] = self._submit(draw.route, draw.key, draw.tenant, rest)

    def _claim_many(self, claims: list[Claim]) -> list[list[int]]:
        """`jobs.claim_many`, each claim noted until its request starts (a busy one made nothing: all or none). Of
        two claims of one request key in a round (a send read twice), the first is noted: the second is busy."""
        for c in claims:
            self._claimed.setdefault(c.key, c)
        answers = self.jobs.claim_many(claims)
        for c, busy in zip(claims, answers, strict=True):
            if busy and self._claimed.get(c.key) is c:
                del self._claimed[c.key]
        return answers

    def _claim_of(self, route: Route, tenant: str, items: list[Pending]) -> Claim:
        """The request for these messages at this provider: its key (the provider's name appended for
        a fallback provider), path and exact body."""
        ids = [p.send.send_id for p in items]
        key = idempotency_key(ids) if route is self.routes.primary else f"{idempotency_key(ids)}-{route.name}"
        path, body = route.adapter.build([Outbound(p.send.send_id, tenant, p.send.lane, p.send.payload)
                                          for p in items], batch=self.lane in route.spec.batch_lanes)
        provider = "" if route is self.routes.primary else route.name
        return Claim(tenant, key, tuple(ids), self.worker_id, path, body, provider,
                     {p.send.send_id: p.attempt for p in items if p.attempt > 1}, route.credentials.account(tenant),
                     route.spec.record_ttl_ms)

    def _buildable_claim(self, d: Draw, held: list[tuple[Draw, str]]) -> Claim | None:
        """The claim of this draw's request; None when there is nothing to send now. A send whose payload
        the adapter cannot read is dead-lettered and the request built without it (the rest is already
        admitted); a request whose shape the adapter refuses (a configuration error) goes to `held`."""
        try:
            return self._claim_of(d.route, d.tenant, d.items)
        except PAYLOAD_ERRORS:
            d.items = self._set_aside_unreadable(d)
        except ValueError as exc:
            held.append((d, str(exc)))
            return None
        if not d.items:
            return None
        try:
            return self._claim_of(d.route, d.tenant, d.items)
        except (*PAYLOAD_ERRORS, ValueError) as exc:
            held.append((d, f"{type(exc).__name__}: {exc}"))
            return None

    def _set_aside_unreadable(self, draw: Draw) -> list[Pending]:
        """The adapter could not read a payload of this request (a field missing or of the wrong type:
        a producer wrote to the lane topic directly, past ingest's validation). Each message is tried
        alone: those it cannot read are dead-lettered (`malformed`, naming the error), and the others
        are returned, to be sent without them."""
        batch = self.lane in draw.route.spec.batch_lanes
        fine: list[Pending] = []
        for p in draw.items:
            try:
                draw.route.adapter.build([Outbound(p.send.send_id, draw.tenant, p.send.lane, p.send.payload)], batch)
            except PAYLOAD_ERRORS as exc:
                self._open.pop(id(p), None)
                # The error's type and, for a missing field, its name: never its text (it may quote the payload).
                what = type(exc).__name__
                if isinstance(exc, KeyError) and exc.args:
                    what = f"missing field {exc.args[0]!r}"
                elif isinstance(exc, UnusablePayload):
                    what = str(exc)
                self.on_unbuildable(p, f"the {draw.route.name} request cannot be built from this payload: {what}")
                continue
            except ValueError:
                pass  # the request's shape, not this payload: the caller holds the queue
            fine.append(p)
        return fine

    def _cap(self, key: str) -> int:
        return self.queue_caps.get(key, self.per_queue or 1)

    def _room(self, key: str) -> bool:
        """Whether another request of this queue may start now (its own cap, its tenant's, the
        worker's, its hold)."""
        return (self.queues.size(key) > 0 and self.queues.queues[key].ready_at <= time.monotonic()
                and len(self.in_flight) < self.concurrency and self.in_flight_by_queue[key] < self._cap(key)
                and not self._tenant_full(self.queues.head_tenant(key)))

    def _fair_share(self, ready: list[str]) -> int | None:
        """The most requests a tenant may have in flight now: `per_tenant`, and no more than an even share of the
        worker's slots among the tenants with work (a request in flight, or a queue ready). With `per_tenant` alone
        (half the slots) two tenants' slow receivers could hold every slot, and a third tenant's deliveries found
        room only when a freed slot happened to come to them first; now each freed slot goes to a tenant under
        its share."""
        if self.per_tenant is None:
            return None
        active = set(self.in_flight_by_tenant) | {self.queues.head_tenant(k) for k in ready if self.queues.size(k)}
        return max(self.per_queue or 1, min(self.per_tenant, self.concurrency // max(1, len(active))))

    def _tenant_full(self, tenant: str, drawn: int = 0) -> bool:
        share = self._tenant_share if self._tenant_share is not None else self.per_tenant
        return share is not None and self.in_flight_by_tenant[tenant] + drawn >= share

    def done(self, job: Job, succeeded: bool, latency_s: float = 0.0) -> None:
        """A request finished (taking `latency_s`): its queue may start another, and earns or loses its share of
        slots."""
        self.routes.of(job.provider).in_flight -= 1
        self.in_flight_by_queue[job.queue] -= 1
        if self.in_flight_by_queue[job.queue] <= 0:
            del self.in_flight_by_queue[job.queue]
        self.in_flight_by_tenant[job.tenant] -= 1
        if self.in_flight_by_tenant[job.tenant] <= 0:
            del self.in_flight_by_tenant[job.tenant]
        if self.per_queue is not None:
            if succeeded:
                cap = self._cap(job.queue) + 1
                if cap >= self.per_queue:
                    self.queue_caps.pop(job.queue, None)
                    self.attempt_s.pop(job.queue, None)
                else:
                    self.queue_caps[job.queue] = cap
            else:
                self.queue_caps[job.queue] = 1
            if job.queue in self.queue_caps:
                before = self.attempt_s.get(job.queue)
                self.attempt_s[job.queue] = latency_s if before is None else (before + latency_s) / 2

    def drain(self, queue: str, tenant: str, rate: float, burst: int) -> tuple[str, float, int]:
        """Whose turns a queue's messages take and at what pace: its tenant's, at its bucket (`rate` a second,
        `burst` at once); or, while its requests fail (a webhook endpoint timing out), its own, at its cap at once
        and its cap per attempt time."""
        cap = self.queue_caps.get(queue)
        if cap is None:
            return tenant, rate, burst
        return queue, min(rate, cap / max(self.attempt_s.get(queue, 0.0), 0.001)), min(burst, cap)

    def tenant_limit(self, route: Route, tenant: str) -> Limit:
        """The tenant's bucket limit at a provider, read from Redis at most every LIMITS_TTL_S
        (operators change it)."""
        cached = self._limits.get((route.name, tenant))
        now = time.monotonic()
        if cached is None or now - cached[0] > LIMITS_TTL_S:
            cached = (now, self.gate.tenant_limit(route.name, tenant))
            self._limits.put((route.name, tenant), cached[1], now)
        return cached[1]

    def per_request(self, route: Route, tenant: str) -> int:
        """Messages per provider request: a batch (up to the tenant's burst) where this lane batches."""
        if self.lane not in route.spec.batch_lanes:
            return 1
        return min(route.spec.batch_max, self.tenant_limit(route, tenant).burst)

    # ---- hand-offs: every message taken ends in exactly one of these
    def _end(self, p: Pending, verdict: str) -> None:
        """A message ended without a request by `by_state`'s verdict (not "send" nor "held")."""
        self._open.pop(id(p), None)
        self._enders[verdict](p)

    def _reconcile(self, tenant: str, request_key: str, send_ids: list[str] | tuple[str, ...],
                   members: list[Pending]) -> None:
        """Leave a request's sends to reconciliation: never sent again by dispatch, each dead-lettered."""
        self.jobs.mark_reconcile(tenant, send_ids, request_key)
        for p in members:
            self._end(p, "unknown_outcome")

    def _requeue(self, key: str, items: list[Pending], hold_until: float | None = None) -> None:
        for p in items:
            self._open.pop(id(p), None)
        self.queues.put_back(key, items, hold_until=hold_until)

    def _start(self, route: Route, job: Job) -> None:
        api_key = route.credentials.for_tenant(job.tenant)
        self._claimed.pop(job.key, None)
        for p in job.members:
            self._open.pop(id(p), None)
        job.stamps["sent"] = wall_ms()
        fut = route.adapter.submit(job.path, job.body, api_key, job.key, job.tenant)
        self.in_flight[fut] = job
        fut.add_done_callback(self.finished.append)
        self.in_flight_by_queue[job.queue] += 1
        self.in_flight_by_tenant[job.tenant] += 1
        route.in_flight += 1

    # ---- the steps
    def _submit(self, route: Route, key: str, tenant: str, fresh: list[Pending]) -> int:
        """Claim these sends again without those a racing worker holds, and start their request: the
        number of messages started."""
        for _ in range(CLAIM_RACE_ROUNDS):
            claim = self._claim_of(route, tenant, fresh)
            busy = set(self._claim_many([claim])[0])
            if not busy:
                self._start(route, Job(claim.key, claim.path, claim.body, tenant, tuple(sorted(claim.send_ids)),
                                       fresh, key, claim.provider))
                return len(fresh)
            self._requeue(key, [fresh[i] for i in sorted(busy)], hold_until=time.monotonic() + 0.5)
            fresh = [p for i, p in enumerate(fresh) if i not in busy]
            if not fresh:
                return 0
        self._requeue(key, fresh)
        return 0

    def _recover(self, request_key: str, tenant: str, group: list[Pending], queue: str, starting: int = 0) -> bool:
        """An earlier request carrying these sends has no known outcome. Re-send it, byte for byte,
        under its own idempotency key, to the provider it went to, once its sender's lease has
        lapsed, and within the worker's concurrency (less the round's `starting` requests) and the provider's pacing.
        False: still held (or no room)."""
        if len(self.in_flight) + starting >= self.concurrency:
            return False  # looked at again shortly: a draw's re-sends are not to pass the worker's concurrency
        stored = self.jobs.take_over(tenant, request_key, self.worker_id, [p.send.send_id for p in group])
        if stored is None:
            return False
        if stored == RECORD_GONE:
            # Unknown for longer than the provider keeps idempotency keys: a re-send could be delivered
            # again, and so could a fresh request. Reconciliation, as for any outcome left unknown.
            self._reconcile(tenant, request_key, [p.send.send_id for p in group], group)
            log.warning("request %s has had no known outcome for longer than providers keep idempotency keys: "
                        "%d of its sends left to reconciliation, not sent again", request_key, len(group))
            return True
        group[:] = self._live(group, stored)  # in place: the caller puts back what is left when this is held
        if not group:
            return True  # only copies of attempts the request carries on already: ended as stale
        route = self.routes.of(stored.provider)
        rekeyed = bool(stored.account) and stored.account != route.credentials.account(stored.tenant)
        if not route.spec.idempotent or rekeyed:
            # It may have been delivered, and a re-send could deliver it twice: at a provider without idempotency
            # keys, or under another key than it went under (the tenant moved to an account of its own, a key
            # rotated: the provider keeps idempotency keys per account, or per key). Reconciliation, as for an
            # unknown answer.
            self.jobs.mark_reconcile(tenant, stored.send_ids, request_key)  # first: Redis failing here loses nothing
            for p in self._with_queued_copies(group, queue, stored):  # (what this takes out of the queue is ended)
                self._end(p, "unknown_outcome")
            why = (f"the key {stored.tenant}'s requests go under changed since it was sent" if rekeyed
                   else f"{route.name} does not honour idempotency keys")
            log.warning("request %s (%d sends) to %s has no known outcome and %s: left to reconciliation, not sent "
                        "again", request_key, len(stored.send_ids), route.name, why)
            return True
        now = time.monotonic()
        held = now < route.shared_account_held_until and route.shares_account(stored.tenant)
        if route.room(now) <= starting or held:
            # The provider's pacing, or the account it goes under refused a moment ago: as for any request.
            self.jobs.keep_unknown(tenant, request_key, self.worker_id, stored.send_ids)  # its record was just read
            return False
        try:
            try:
                admission = self.gate.acquire(route.name, stored.tenant, len(stored.send_ids), reserve=self.reserve)
            except CostExceedsBurst:
                # Stored before the tenant's burst was lowered: it cannot be split (same body, same key),
                # so it is charged a full burst instead of never being admitted.
                burst = self.gate.tenant_limit(route.name, stored.tenant).burst
                admission = self.gate.acquire(route.name, stored.tenant, burst, reserve=self.reserve)
        except (BucketUnreadable, ConfigError, CostExceedsBurst) as exc:  # its tenant's alone (buckets, limits): held
            log.error("%s; holding request %s", exc, request_key)
            admission = Admission(False)
        if not admission.allowed:
            self.jobs.keep_unknown(tenant, request_key, self.worker_id, stored.send_ids)  # its record was just read
            return False
        members = self._with_queued_copies(group, queue, stored)
        self._start(route, Job(request_key, stored.path, stored.body, stored.tenant, stored.send_ids, members, queue,
                               stored.provider, resent=True))
        log.info("re-sending request %s (%d sends) to %s after an unknown outcome", request_key,
                 len(stored.send_ids), route.name)
        return True

    def _with_queued_copies(self, group: list[Pending], queue: str, stored: StoredRequest) -> list[Pending]:
        """Other messages of ours that belong to a recovered request settle with it; of two copies of one send
        (the lane message and its retry copy, both read again after a crash) only the later attempt's, and the
        other is ended as a duplicate: each would carry a retry chain of its own on, or a dead letter of its own."""
        members, duplicates = unique_sends(group + self._live(self.queues.splice(queue, stored.send_ids), stored))
        for p in duplicates:
            self._end(p, "duplicate")
        return members

    def _live(self, copies: list[Pending], stored: StoredRequest) -> list[Pending]:
        """The copies not behind the attempt the request carries their send on (the attempt it was claimed for, or
        the one a copy made after it failed again carries on); the others are ended as stale: sent with it, each
        would carry a second chain of attempts on."""
        live = []
        for p in copies:
            if p.attempt < stored.attempts.get(p.send.send_id, 0):
                self._end(p, "stale")
            else:
                live.append(p)
        return live

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
        """The providers own the requests' threads or event loop."""
        if not self.release_unsent_claims():
            log.warning("%d claim(s) never sent could not be released: their sends are taken over once their "
                        "leases lapse", len(self._unsent_claims))
        self.routes.close()
