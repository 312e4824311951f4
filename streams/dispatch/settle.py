"""What happens after a provider request: every message it carried reaches a durable outcome.

Delivered: outcome events (acknowledged) first, then the `delivered` mark, then the offsets. A
crash in between leaves the sends in flight: the next worker re-sends the same request under the
same key, the provider replays its answer, and the outcomes are published again (at least once).
Not delivered: a 429 holds every worker off the provider (shared cool-down); a short one is waited
out here; a rejection for one of the provider's named fallback reasons goes once to the channel's
next provider; a 401 that a fresh token or key did not cure holds the provider (or the tenant's
key) and raises an alert, without using up attempts; anything else is copied to a retry tier or
dead-lettered, per the send's retry policy.

Redis failing in the middle never loses a settlement: the Redis steps of a failed request run
before anything is written to Kafka, and a settlement (or a `delivered` mark) that meets a Redis
error is kept and tried again, with backoff, with the timestamps of the original answer.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Container
from dataclasses import replace

from .. import metrics
from ..backoff import Outage
from ..errors import StoreUnavailable
from ..gate.gate import Gate, Unused, give_back
from ..kafka_client import after_all
from ..logs import evidence
from ..offsets import OffsetTracker
from ..providers.outcome import ProviderResult
from ..retry.policy import (
    IN_PROCESS_BACKOFF_MAX_S,
    DeadLetter,
    RetryAt,
    RetryPolicy,
    cool_down_s,
    decide,
    expired,
    parse_retry_after,
    tier_at_least,
    wait_in_process,
)
from .growing_holds import GrowingHolds
from .idempotency import ProcessedJobs
from .records import OnAck, RecordWriter, attempt_info
from .requests import Job
from .routes import Route, Routes
from .stages import StageLog, wall_ms
from .tenant_queues import Offset, Pending, TenantQueues

log = logging.getLogger("streams.settle")
AUTH_HOLD_S = 30.0
# A webhook receiver asking to wait a few seconds, answer after answer, is not counted against its endpoint's
# health for this long (a burst it rate-limits); past it, each such answer counts, and one that never stops
# asking degrades the endpoint instead of holding its deliveries, and its partition's offset, in the worker.
HELD_UNCOUNTED_MS = 60_000
# Answers that say the provider took our key (a timeout, a 5xx or a 429 may come before it looks at the key)
KEY_ACCEPTED = frozenset({"delivered", "rejected", "skipped", "gone"})


def providers_tried(p: Pending, route: Route, known: Container[str]) -> list[str]:
    """The providers this send has been tried on, this one included (from its retry headers): only names of the
    channel's providers, `known` (the header is read from a topic anyone may write, and is copied into every
    outcome record: a long one made a record of a hundred outcomes one the broker refused, and the worker exit)."""
    header = (p.headers.get("providers_tried") or b"").decode(errors="replace").split(",")
    earlier = list(dict.fromkeys(n for n in header if n in known))  # each once, in order
    return earlier if route.name in earlier else [*earlier, route.name]


def earlier_attempts(job: Job) -> dict[str, int]:
    """Per send of a released request, the attempt before the one just released (0: none): its copy was read
    from the broker, so the send stays `tried:<n>` through the release (see release.lua)."""
    earlier: dict[str, int] = {}
    for p in job.members:
        earlier[p.send.send_id] = max(earlier.get(p.send.send_id, 0), p.attempt - 1)
    return earlier


class Settler:
    def __init__(self, routes: Routes, label: tuple[str, str], queues: TenantQueues, tracker: OffsetTracker,
                 jobs: ProcessedJobs, gate: Gate, records: RecordWriter, policies: dict[str, RetryPolicy],
                 redis_outage: Outage, worker_id: str, on_gone: Callable[[Job, ProviderResult], bool] | None = None):
        """`worker_id` holds the leases of this worker's requests (releases are asked in its name);
        `on_gone` runs when a receiver answered 410 (the webhook channel disables the endpoint); False: the
        answer no longer speaks for the endpoint (its URL changed meanwhile), and the attempt is retried."""
        self.routes = routes
        self.worker_id = worker_id
        self.on_gone = on_gone
        self.time_scale = 1.0  # tests that walk a whole retry schedule shrink it (same code path)
        self.auth_hold_s = AUTH_HOLD_S
        self.stage_log = StageLog(None)  # the latency benchmark points it at a file
        self.label = label
        self.queues, self.tracker, self.jobs, self.gate = queues, tracker, jobs, gate
        self.records = records
        self.policies = policies
        self.outage = redis_outage
        self.unsettled: list[tuple[Job, ProviderResult, int]] = []  # met a Redis error; tried again
        self.unmarked: list[Job] = []  # delivered and recorded, the `delivered` mark not yet written
        self.to_mark: list[Job] = []   # acknowledged during this poll; marked together by `flush_marks`
        # Failed attempts whose copy is acknowledged: (tenant, send id, attempt, offset, the request's key when its
        # claim is kept, else ""), marked `tried:<n>` (or, kept, the next attempt noted on the request) together
        # by `flush_marks`, then finished (kept while Redis fails).
        self.to_mark_tried: list[tuple[str, str, int, Offset, str]] = []
        self.auth_refusals = GrowingHolds()  # queues whose tenant's own provider key is refused
        # Queues held for long (an endpoint's Retry-After, a tenant's refused key, a tenant without limits):
        # queue -> (monotonic end, wall-clock end in ms, the retry_reason of what is spilled)
        self.long_holds: dict[str, tuple[float, int, str]] = {}
        self.rng = random.Random()
        self._end_to_end = metrics.END_TO_END.labels(*label)  # observed per delivered message

    def finisher(self, where: Offset) -> Callable[[], object]:
        return lambda: self.tracker.finish(*where)

    def _tried_then_finish(self, job: Job, p: Pending, kept: bool = False) -> Callable[[], object]:
        """Once the copy that carries a failed attempt on is acknowledged: mark the send `tried:<attempt>` (in
        `flush_marks`), then finish its message. Not before: a worker that died with the copy unacknowledged
        must leave the message, read again, free to be sent again, never stale. `kept`: the request stays
        claimed (its outcome unknown), so no mark can be written over its claim: the next attempt is noted on the
        request instead, and a copy for this attempt or an earlier one that meets it later is stale."""
        return self._mark_tried_then_finish(p, job.key if kept else "")

    def _mark_tried_then_finish(self, p: Pending, key: str = "") -> Callable[[], object]:
        """`_tried_then_finish` for one message (`key`: the request that stays claimed, "" for none)."""
        return lambda: self.to_mark_tried.append((p.send.tenant_id, p.send.send_id, p.attempt, p.where, key))

    @property
    def pending(self) -> int:
        return len(self.unsettled) + len(self.unmarked) + len(self.to_mark) + len(self.to_mark_tried)

    def flush_marks(self) -> None:
        """Mark the requests acknowledged since the last flush delivered (one round trip), then finish
        their offsets; on a Redis error they wait in `unmarked` and are tried one by one later. Likewise the
        failed attempts whose copies are acknowledged (`tried:<n>`), kept and tried again on a Redis error."""
        self._flush_tried()
        if not self.to_mark:
            return
        jobs, self.to_mark = self.to_mark, []
        try:
            self.jobs.mark_delivered_many([(j.tenant, j.send_ids, j.key) for j in jobs])
        except StoreUnavailable as exc:
            self.outage.failed(time.monotonic(), exc)
            self.unmarked.extend(jobs)
            return
        self.outage.recovered(time.monotonic())
        stamp = wall_ms()
        for job in jobs:
            for p in job.members:
                self.tracker.finish(*p.where)
                if self.stage_log.on:
                    self.stage_log.write(p.send.send_id, p.send.created_at_ms,
                                         {"consumed": p.consumed_at_ms, **job.stamps, "marked": stamp})

    def _flush_tried(self) -> None:
        if not self.to_mark_tried or not self.outage.ready(time.monotonic()):
            return
        tried, self.to_mark_tried = self.to_mark_tried, []
        try:
            self.jobs.mark_tried_many([(tenant, send_id, attempt) for tenant, send_id, attempt, _, key in tried
                                       if not key])
            self.jobs.note_attempts([(tenant, key, send_id, attempt + 1) for tenant, send_id, attempt, _, key in tried
                                     if key])
        except StoreUnavailable as exc:
            self.outage.failed(time.monotonic(), exc)
            self.to_mark_tried = tried + self.to_mark_tried
            return
        self.outage.recovered(time.monotonic())
        for _, _, _, where, _ in tried:
            self.tracker.finish(*where)

    def settle(self, job: Job, result: ProviderResult, now_ms: int | None = None) -> None:
        """Settle one finished request; on a Redis error keep it for `retry`."""
        now_ms = now_ms or int(time.time() * 1000)
        if result.outcome in KEY_ACCEPTED:
            self.auth_refusals.clear(job.queue)  # its key is taken again
        if result.outcome == "delivered" and result.message_ids and len(result.message_ids) != len(job.send_ids):
            # A 2xx naming more or fewer messages than the request held (a batch partly refused, as a permissive
            # batch mode answers): which were taken is not said, so none is called delivered. Asked again under
            # its key (answered from the provider's store), it ends dead-lettered unknown_outcome, for an
            # operator to check, rather than every email of the batch recorded delivered.
            result = replace(result, outcome="unknown", error_name="message_count_mismatch")
        try:
            if result.outcome == "delivered":
                self._delivered(job, result, now_ms)
            elif result.outcome == "skipped":
                self._skipped(job, result, now_ms)
            else:
                self._failed(job, result, now_ms)
        except StoreUnavailable as exc:
            self.outage.failed(time.monotonic(), exc)
            self.unsettled.append((job, result, now_ms))

    def retry(self) -> None:
        """Try again what met a Redis error, once the backoff allows (stop at the first failure)."""
        while self.unmarked and self.outage.ready(time.monotonic()):
            self._mark(self.unmarked.pop(0))
        while self.unsettled and self.outage.ready(time.monotonic()):
            self.settle(*self.unsettled.pop(0))

    def _released(self, job: Job) -> bool:
        """Free the sends of a request the provider did not accept; False when they stay claimed under its key
        (another worker took it over, or met an unknown outcome re-sending it): settled as kept then, its retry
        copies carrying the sends on under that key (never split, never to another provider)."""
        return self.jobs.release(job.tenant, job.send_ids, job.key, self.worker_id, earlier_attempts(job))

    def _keep_unknown(self, job: Job) -> None:
        """Keep the request claimed, to be re-sent under its key; said when its record was lost meanwhile."""
        if reconciled := self.jobs.keep_unknown(job.tenant, job.key, self.worker_id, job.send_ids):
            log.warning("request %s has no known outcome and its record is gone (a Redis failover lost it): %d of "
                        "its %d sends left to reconciliation, not sent again", job.key, reconciled,
                        len(job.send_ids))

    def _skipped(self, job: Job, result: ProviderResult, now_ms: int) -> None:
        """Never attempted (its endpoint was deleted or disabled): recorded as skipped, not retried.
        It stays replayable while its payload is kept (a replay is a new send). Final: once its record is
        acknowledged the send is marked `tried:<attempt>`, so a copy of it read again (a retry copy the
        retrier releases again, a rebalance) is stale, never delivered hours late under its old id. A
        re-sent request keeps its claim (its first copy's fate is unknown), as after any failure. Nothing left:
        the tenant and the provider get their tokens back (past every Redis step, so given back once)."""
        kept = job.resent or result.first_copy_unknown
        if kept:
            self._keep_unknown(job)
        else:
            kept = not self._released(job)
        self.outage.recovered(time.monotonic())
        give_back(self.gate, [Unused(self.routes.of(job.provider).name, job.tenant, len(job.send_ids))])
        for p in job.members:
            self.records.skipped(p, result.error_name, now_ms, self._tried_then_finish(job, p, kept))

    def _failed(self, job: Job, result: ProviderResult, now_ms: int) -> None:
        if result.outcome == "gone" and self.on_gone is not None and not self.on_gone(job, result):
            # The 410 came from a URL the endpoint no longer has: a failure of this attempt, retried at the new one.
            result = replace(result, outcome="unavailable", error_name="gone_before_url_change")
        route = self.routes.of(job.provider)
        resent = job.resent or result.first_copy_unknown  # the provider may hold an earlier copy under this key
        # A webhook receiver is the tenant's own server, and many echo the event they got (a person's data no
        # redaction knows): its answer is kept nowhere, only its status and error name.
        body = None if route.spec.channel == "webhook" else result.error_body[:300]
        evidence(log, logging.WARNING, "attempt_failed", provider=route.name, request=job.key,
                 sends=len(job.send_ids), send_id=job.send_ids[0] if len(job.send_ids) == 1 else None,
                 tenant=job.tenant, status=result.status, outcome=result.outcome, error=result.error_name,
                 duration_s=round(result.latency_s, 3), body=body)
        wait = cool_down_s(result, now_ms)
        # Counted from the answer: a settlement tried again after a Redis error holds off what is left of the ask,
        # not all of it again from now.
        left = 0.0 if wait is None else wait - max(0.0, time.time() - now_ms / 1000)
        if wait is not None:
            metrics.PROVIDER_429.labels(route.name, result.error_name or result.outcome).inc()
        if left > 0:
            own = route.credentials.has_own_key(job.tenant)
            if route.spec.shared_limit:  # the account's limit: every worker sending under it holds off it
                self.gate.cool_down(route.name, left, tenant=job.tenant if own else None)
            if own or not route.spec.shared_limit:  # the tenant's own account, or a webhook endpoint's own limit:
                # this queue is held here as well (a long wait parks what it holds, as for a long hold)
                self._hold_queue(job.queue, left, int(time.time() * 1000),  # `left`: counted from now
                                 parse_retry_after(result.retry_after, now_ms) is not None)
        kept = False
        if result.outcome == "unknown" and not route.spec.idempotent:
            self.jobs.mark_reconcile(job.tenant, job.send_ids, job.key)
        elif result.outcome == "unknown" or (resent and route.spec.idempotent):
            kept = True
            # A failed re-send (a 429, a refused connection, a 401...) says nothing of the first
            # copy, which the provider may have accepted: the sends stay claimed under this key, and
            # only this request, byte for byte, is sent again (answered from the provider's store).
            self._keep_unknown(job)
        else:
            kept = not self._released(job)
        self.outage.recovered(time.monotonic())
        # The provider may hold another copy of the request (re-sent, or still claimed by another worker's re-send):
        # its sends go on under its key at this provider only, and one given up on is `unknown_outcome`.
        maybe_held = kept or resent
        # Past every Redis step (a Redis error above retries the whole settlement): announced once.
        split = result.status == 413 and len(job.members) > 1 and not maybe_held
        if split or (wait is not None and route.spec.channel != "webhook"):
            # The provider declined to look at the messages (a 429; a batch refused for its size, split below):
            # charged again when they go, the tenant gets them back now, or another tenant's throttling would
            # spend its quota (a day's limit). The request's own token stays spent: the provider counted it.
            # (A receiver's 429 counts as an attempt of its webhook delivery, and as a charge.)
            give_back(self.gate, [Unused(route.name, job.tenant, len(job.send_ids), 0)])
        elif result.never_sent:  # the provider counted nothing: the request's own token comes back as well
            give_back(self.gate, [Unused(route.name, job.tenant, len(job.send_ids))])
        if split:
            # A batch refused for its size says nothing of each message: each is sent again alone, at once and
            # without using up an attempt (none was taken). Only then: split on any 4xx, a blast whose every
            # message is refused (an unverified sender domain) would cost a request per message of the budget
            # every tenant shares, to the same end.
            for p in job.members:
                p.alone = True
            self.queues.put_back(job.queue, list(job.members))
            metrics.SENDS.labels(*self.label, "batch_refused_split").inc(len(job.members))
            return
        if result.outcome == "auth":
            self._unauthorised(route, job, result, now_ms)
            return
        if wait_in_process(result, now_ms):
            for p in job.members:
                p.held_since_ms = p.held_since_ms or now_ms
                self._announce(p, result, now_ms, held=now_ms - p.held_since_ms < HELD_UNCOUNTED_MS)
            self._back_off_in_process(job, result, now_ms)
            return
        for p in job.members:
            tried = providers_tried(p, route, self.routes.by_name)
            # Another provider could deliver a request the provider may hold a second time: it never moves on.
            fallback = None if maybe_held else self.routes.fallback_for(route, result, tried)
            if fallback is not None:  # once, on a named reason, through the next provider's own bucket
                metrics.FALLBACKS.labels(self.label[0], route.name, fallback.name, result.error_name).inc()
                self.records.fallback(p, fallback.name, tried, result, now_ms, self._tried_then_finish(job, p, kept))
                continue
            decision = self._decide(route, p, result, now_ms, maybe_held)
            finish = self._announced(p, result, now_ms, decision.reason if isinstance(decision, DeadLetter) else "",
                                     self._tried_then_finish(job, p, kept))
            if isinstance(decision, RetryAt):
                self.records.retry(p, decision, result, now_ms, finish, tried, kept=kept)
            elif isinstance(decision, DeadLetter):
                self.records.dead_letter(p, decision.reason, result, now_ms, finish, tried,
                                         declined_now=decision.declined)
            else:  # Delivered cannot follow a failed result
                raise AssertionError(decision)

    def _hold_queue(self, queue: str, wait: float, now_ms: int, asked: bool) -> None:
        """A 429 from a limit of one queue's own (a webhook endpoint's, a tenant's account at a provider)
        holds that queue until Retry-After (a long wait: `hold_long`)."""
        if wait > IN_PROCESS_BACKOFF_MAX_S:
            self.hold_long(queue, wait, "endpoint_retry_after", now_ms)
        elif (held := self.long_holds.get(queue)) is not None and held[2] != "endpoint_retry_after":
            pass  # held for a reason of the queue's own (its key refused): a 429 meanwhile does not end that
        else:
            self.queues.hold(queue, time.monotonic() + wait)
            if asked:  # the receiver's latest word: a short Retry-After it gave ends a long one
                self.long_holds.pop(queue, None)

    def hold_long(self, queue: str, wait: float, reason: str, now_ms: int | None = None) -> None:
        """Hold one queue for `wait` s (a longer hold it is under stays). What it holds and what arrives for it
        meanwhile is not kept in memory past IN_PROCESS_BACKOFF_MAX_S: `spill_long_holds` parks it on the retry
        tier due when the hold ends, so that its partition's offset moves on (a held message would pin it, and
        the lane's lag, for every tenant), and each message's age is checked again when it comes back."""
        until = time.monotonic() + wait
        if (held := self.long_holds.get(queue)) is not None and held[0] >= until:
            return
        self.queues.hold(queue, until)
        if wait > IN_PROCESS_BACKOFF_MAX_S:
            now_ms = now_ms or int(time.time() * 1000)
            self.long_holds[queue] = (until, now_ms + int(wait * 1000), reason)

    def spill_long_holds(self, end_expired: Callable[[list[Pending]], list[Pending]]) -> None:
        """`end_expired` ends, by its send's state, what is due after its max age (it could never be
        sent in time) and gives back what it could not end (Redis down): that is spilled too, and
        looked at again when it comes back."""
        if not self.long_holds:
            return
        now, now_ms = time.monotonic(), int(time.time() * 1000)
        for queue, (until, due_ms, reason) in list(self.long_holds.items()):
            if until - now <= IN_PROCESS_BACKOFF_MAX_S:  # the rest of the wait is spent in memory
                del self.long_holds[queue]
                continue
            # Never due before the hold ends: a settlement retried after a Redis outage timed its due time from the
            # answer, long ago, and a wall clock may have stepped ahead; a copy due already would come straight
            # back, be spilled again, and go round the tier until the hold ended.
            due_ms = max(due_ms, now_ms + int((until - now) * 1000))
            while self.queues.size(queue):
                taken = self.queues.take(queue, self.queues.size(queue))
                too_old = [p for p in taken if expired(self.policies[p.send.policy], p.send.created_at_ms, due_ms)]
                ended = {id(p) for p in too_old} - {id(p) for p in (end_expired(too_old) if too_old else [])}
                for p in taken:
                    if id(p) not in ended:
                        self.records.spill(p, due_ms, tier_at_least((due_ms - now_ms) / 1000),
                                           self.finisher(p.where), reason=reason)

    def _unauthorised(self, route: Route, job: Job, result: ProviderResult, now_ms: int) -> None:
        """The provider refused us even with a fresh token (or our key): retrying down the tiers
        would only use up attempts. Hold the provider (token, or the key everyone shares: one account for
        everyone) or the tenant's queue (its own key), page someone, and try again after the hold; the sends'
        age is still checked before every attempt, so they are never sent too late."""
        metrics.PROVIDER_AUTH_FAILURES.labels(route.name).inc()
        shared = route.shares_account(job.tenant)
        hold_s = self.auth_hold_s if shared else self.auth_refusals.hold_for(job.queue, self.auth_hold_s,
                                                                             time.monotonic())
        evidence(log, logging.ERROR, "provider_auth_failed", provider=route.name, tenant=job.tenant,
                 status=result.status, error=result.error_name, hold_s=round(hold_s, 1),
                 action="check the provider credentials (alert ProviderAuthFailing)")
        if shared:
            # Every queue of the provider sent under that account waits, in memory (parking them all would only
            # send every message round the retry tiers until it is cured), those empty now or new meanwhile too
            # (dispatch reads the route's hold); tenants with keys of their own go on.
            until = time.monotonic() + hold_s
            route.shared_account_held_until = max(route.shared_account_held_until, until)
            self.queues.put_back(job.queue, list(job.members), hold_until=until)
            return
        # The tenant's own key: its queue alone, parked off the partition while it lasts (longer each time).
        self.queues.put_back(job.queue, list(job.members))
        self.hold_long(job.queue, hold_s, "auth_refused", now_ms)

    def _announce(self, p: Pending, result: ProviderResult, now_ms: int, dropped: str = "",
                  on_ack: OnAck | None = None, held: bool = False) -> None:
        """Every webhook attempt is an event on the attempts topic; `dropped` marks the attempt after
        which the delivery was given up, with why (endpoint health counts both; its alert names why);
        `held`, one the worker tries again after the few seconds the receiver asked for (not counted)."""
        if p.send.channel == "webhook":
            self.records.webhook_attempt(p, result, now_ms, dropped, on_ack, held)

    def _announced(self, p: Pending, result: ProviderResult, now_ms: int, dropped: str, then: OnAck) -> OnAck:
        """`_announce`, returning what to give the record that settles the message: `then` runs once that
        record and the attempt event (a webhook's) are both acknowledged."""
        if p.send.channel != "webhook":
            return then
        done = after_all(2, then)
        self._announce(p, result, now_ms, dropped, done)
        return done

    def dead_letter_too_old(self, p: Pending) -> None:
        """A send found older than its policy's max_age before an attempt: never sent late. Once its letter is
        acknowledged it is marked `tried:<attempt>`, so the same copy released again (a retrier restarted behind a
        copy due days ahead) is stale, not dead-lettered a second time."""
        self.records.dead_letter(p, "too_old", None, int(time.time() * 1000), self._mark_tried_then_finish(p))

    def dead_letter_unknown_outcome(self, p: Pending) -> None:
        """Its request went to a provider without idempotency keys and its sender stopped before the
        answer: it may have been delivered, so it waits for reconciliation, never sent again by itself."""
        self.records.dead_letter(p, "unknown_outcome", None, int(time.time() * 1000), self.finisher(p.where),
                                 attempted=True)  # its request went out: this attempt was made, its outcome unknown

    def dead_letter_unbuildable(self, p: Pending, detail: str) -> None:
        """A send whose payload the provider adapter cannot turn into a request: it never can be."""
        self.records.dead_letter(p, "malformed", None, int(time.time() * 1000), self.finisher(p.where), detail=detail)

    def _decide(self, route: Route, p: Pending, result: ProviderResult, now_ms: int, maybe_held: bool):
        """`maybe_held`: the provider may hold another copy of the request (re-sent, or still claimed under its key
        by another worker's re-send): a send given up on is dead-lettered `unknown_outcome`."""
        return decide(self.policies[p.send.policy], p.attempt, p.send.created_at_ms, result, now_ms,
                      self.rng.random(), provider_idempotent=route.spec.idempotent, time_scale=self.time_scale,
                      first_copy_unknown=maybe_held, throttle_is_attempt=route.spec.channel == "webhook",
                      declined_before=p.declined)

    def _back_off_in_process(self, job: Job, result: ProviderResult, now_ms: int) -> None:
        """A short 429: the request was not accepted, so its sends go back to the front of their
        tenant queue (the shared cool-down, or this queue's own hold, keeps them until Retry-After). It does not
        use up an attempt (the provider never looked at the sends); their age is checked again
        before the next attempt, as before every attempt."""
        self.queues.put_back(job.queue, list(job.members))
        metrics.SENDS.labels(*self.label, "throttled_in_process").inc(len(job.members))

    def _delivered(self, job: Job, result: ProviderResult, now_ms: int) -> None:
        ids = provider_ids(job, result)
        route = self.routes.of(job.provider)
        events = []
        held = set()
        announced: list[Pending] = []
        for p in job.members:
            if p.send.send_id in held:
                continue
            held.add(p.send.send_id)
            announced.append(p)
            self._end_to_end.observe(max(0, now_ms - p.send.created_at_ms) / 1000)
            events.append({**self.records.outcome_event(p.send, "delivered", p.attempt, now_ms,
                                                        ids.get(p.send.send_id, ""),
                                                        attempt=attempt_info(p.attempt, result, now_ms),
                                                        tried=providers_tried(p, route, self.routes.by_name)),
                           "origin": self.records.origin(p)})
        for send_id in job.send_ids:
            if send_id not in held:  # recovered request: a send whose message another consumer holds
                events.append(self.records.delivered_elsewhere_event(send_id, job.tenant, now_ms,
                                                                     ids.get(send_id, "")))
        def acked() -> None:  # runs inside the producer's poll: it must not raise
            job.stamps["acked"] = wall_ms()
            self.to_mark.append(job)  # marked with the others of this poll, in one round trip

        metrics.SENDS.labels(*self.label, "delivered").inc(len(held))
        if any(p.send.channel == "webhook" for p in announced):  # the attempt events are acknowledged too
            all_acked = after_all(len(announced) + 1, acked)
            for p in announced:
                self._announce(p, result, now_ms, on_ack=all_acked)
        else:
            all_acked = acked
        # One record per request (up to 100 events each), not one per send: a record for the broker
        # to acknowledge, and a delivery report to serve, per request; `acked` once all are.
        self.records.outcomes(events, job.key, all_acked)

    def _mark(self, job: Job) -> None:
        """Mark the request's sends delivered, then finish their offsets; on a Redis error keep it."""
        try:
            self.jobs.mark_delivered(job.tenant, job.send_ids, job.key)
        except StoreUnavailable as exc:
            self.outage.failed(time.monotonic(), exc)
            self.unmarked.append(job)
            return
        self.outage.recovered(time.monotonic())
        for p in job.members:
            self.tracker.finish(*p.where)


def provider_ids(job: Job, result: ProviderResult) -> dict[str, str]:
    """Each send's id at the provider: a batch's answer lists them in the order of the request's messages, which
    an adapter writes in send-id order (`Provider.build`), a stored request re-sent byte for byte too. An answer
    whose count of ids is not the request's names none (an id is never given to another send)."""
    if len(result.message_ids) != len(job.send_ids):
        return {}
    return dict(zip(sorted(job.send_ids), result.message_ids, strict=True))
