"""The lane worker's loop driven with in-memory fakes (no broker, no Redis, no HTTP): what a user of
the worker notices, such as which sends reach the provider, what is written to Kafka and which
offsets are stored, for the delivered, throttled, rejected and duplicate paths."""

from __future__ import annotations

import itertools
import time
from collections import Counter, defaultdict
from concurrent.futures import Future
from dataclasses import replace
from types import SimpleNamespace

import orjson
import pytest
from confluent_kafka import KafkaError

from streams.dispatch import settle as settle_module
from streams.dispatch.backlog import HORIZON_S, BacklogShare
from streams.dispatch.idempotency import RECORD_GONE, StoredRequest, idempotency_key
from streams.dispatch.requests import COOL_DOWN_RECHECK_S, Job
from streams.dispatch.routes import Route, Routes
from streams.dispatch.settle import provider_ids
from streams.dispatch.tenant_queues import Pending
from streams.dispatch.worker import LaneWorker, WorkerConfig
from streams.errors import BucketUnreadable, ConfigError, GateUnavailable, StoreUnavailable
from streams.gate.gate import Admission, Unused
from streams.gate.limits import Pacing
from streams.gate.token_bucket import Limit
from streams.names import TopicNames
from streams.outcomes import events_of
from streams.providers.outcome import ProviderResult, classify, redact
from streams.providers.registry import ProviderCredentials, load_registry
from streams.retry.policy import load_policies
from streams.send import build_send, encode, validate_request
from tests.harness import email_request, sms_request, wait_until, webhook_event

NAMES = TopicNames("u.")
TOPIC = NAMES.lane("email", "transactional")


class FakeMessage:
    def __init__(self, partition: int, offset: int, value: bytes, headers=None):
        self._p, self._o, self._v, self._h = partition, offset, value, headers or []

    def topic(self): return TOPIC
    def partition(self): return self._p
    def offset(self): return self._o
    def value(self): return self._v
    def key(self): return b"k"
    def headers(self): return self._h
    def error(self): return None


class FakeConsumer:
    def __init__(self, messages):
        self.pending = list(messages)
        self.stored: dict[tuple[str, int], int] = {}
        self.on_assign = None
        self.topics = [TOPIC]

    def subscribe(self, topics, on_assign=None, on_revoke=None, on_lost=None):
        self.on_assign, self.topics = on_assign, list(topics)

    def poll(self, timeout=0):
        msgs = self.consume(1, timeout)
        return msgs[0] if msgs else None

    def consume(self, num_messages=1, timeout=0):
        if self.on_assign:
            assign, self.on_assign = self.on_assign, None
            assign(self, [_TP(t, p) for t in self.topics for p in range(2)])
        out, self.pending = self.pending[:num_messages], self.pending[num_messages:]
        return out

    def store_offsets(self, offsets):
        for tp in offsets:
            self.stored[(tp.topic, tp.partition)] = tp.offset

    def position(self, partitions):
        from confluent_kafka import TopicPartition
        return [TopicPartition(tp.topic, tp.partition, -1001) for tp in partitions]  # no position known

    def incremental_assign(self, partitions): pass
    def pause(self, partitions): pass
    def resume(self, partitions): pass
    def commit(self, asynchronous=True): pass
    def close(self): pass


class _TP:
    def __init__(self, topic, partition):
        self.topic, self.partition = topic, partition


class FakeProducer:
    def __init__(self):
        self.records: dict[str, list[tuple[bytes | None, dict]]] = defaultdict(list)
        self._acks = []

    def produce(self, topic, value=None, key=None, headers=None, on_delivery=None):
        self.records[topic].append((value, dict(headers or [])))
        if on_delivery:
            self._acks.append((on_delivery, FakeMessage(0, len(self.records[topic]) - 1, value)))

    def poll(self, timeout=0):
        acks, self._acks = self._acks, []
        for ack, written in acks:
            ack(None, written)
        return len(acks)

    def flush(self, timeout=0):
        return self.poll() and 0


class FakeGate:
    """Admits every tenant but `short_tenants`; `spent` counts the tokens each (provider, tenant) holds spent:
    messages and requests admitted, less what was given back."""

    def __init__(self, short_tenants=(), rates=None, bursts=None):
        self.short_tenants = set(short_tenants)
        self.rates, self.bursts = rates or {}, bursts or {}
        self.spent: Counter = Counter()

    def acquire(self, provider, tenant, messages, reserve=False):
        if tenant in self.short_tenants:
            return Admission(False, 3600.0, "tenant")
        self.spent[(provider, tenant, "messages")] += messages
        self.spent[(provider, tenant, "requests")] += 1
        return Admission(True)

    def acquire_many(self, requests):
        return [self.acquire(*r) for r in requests]

    def refund_many(self, admitted):
        for provider, tenant, messages, requests in map(lambda a: Unused(*a), admitted):
            self.spent[(provider, tenant, "messages")] -= messages
            self.spent[(provider, tenant, "requests")] -= requests

    def cool_down(self, provider, seconds, tenant=None): pass
    def refresh_cool_downs(self): pass
    def tenant_limit(self, provider, tenant): return Limit(self.rates.get(tenant, 1000), self.bursts.get(tenant, 100))
    def pacing(self, provider): return Pacing()


class FakeJobs:
    """processed_jobs in a dict: free, inflight:<key>, delivered, reconcile or tried:<n> (free to claim)."""

    def __init__(self, delivered=()):
        self.state = {s: "delivered" for s in delivered}

    def ping(self): pass
    def status(self, tenant, send_ids): return [self.state.get(s) for s in send_ids]
    def status_many(self, groups): return [self.status(t, ids) for t, ids in groups]
    def claim_many(self, claims): return [self.claim(list(c.send_ids), c.key, c.owner, c.path, c.body, c.tenant,
                                                     c.provider, c.attempts, c.account) for c in claims]
    def mark_delivered_many(self, requests):
        for tenant, ids, key in requests:
            self.mark_delivered(tenant, ids, key)

    def claim(self, send_ids, key, owner, path, body, tenant, provider="", attempts=None, account=""):
        busy = [i for i, s in enumerate(send_ids) if not self.state.get(s, "tried:").startswith("tried:")]
        if not busy:
            self.state.update({s: f"inflight:{key}" for s in send_ids})
        return busy

    def take_over(self, tenant, key, owner, send_ids=()): return None
    def mark_delivered(self, tenant, send_ids, key): self.state.update({s: "delivered" for s in send_ids})
    def mark_reconcile(self, tenant, send_ids, key): self.state.update({s: "reconcile" for s in send_ids})

    def release(self, tenant, send_ids, key, owner, earlier=None):
        for s in send_ids:
            n = (earlier or {}).get(s, 0)
            if n > 0:
                self.state[s] = f"tried:{n}"
            else:
                self.state.pop(s, None)
        return True

    def release_unsent(self, claims):
        for c in claims:
            if all(self.state.get(s) == f"inflight:{c.key}" for s in c.send_ids):
                self.release(c.tenant, c.send_ids, c.key, c.owner, {s: n - 1 for s, n in c.attempts.items()})

    def mark_tried_many(self, tried):
        for _, s, n in tried:
            state = self.state.get(s)
            if state is None or (state.startswith("tried:") and int(state[6:]) < n):
                self.state[s] = f"tried:{n}"

    def keep_unknown(self, tenant, key, owner, send_ids): return 0
    def refresh(self, leases, owner): pass
    def note_attempts(self, noted): pass


class FakeProvider:
    name = "resend"
    ready = True

    def poll(self): pass

    def __init__(self, answer: ProviderResult):
        self.answer = answer
        self.sent: list[bytes] = []

    def build(self, messages, batch):
        return "/emails", b"|".join(m.send_id.encode() for m in messages)

    def post(self, path, body, api_key, idempotency_key):
        self.sent.append(body)
        return self.answer

    def submit(self, path, body, api_key, idempotency_key, tenant):
        done = Future()
        done.set_result(self.post(path, body, api_key, idempotency_key))
        return done

    def close(self): pass


def _messages(tenants: list[str]):
    sends = [build_send(validate_request(email_request()), t) for t in tenants]
    return sends, [FakeMessage(0, i, encode(s)) for i, s in enumerate(sends)]


DELIVERED = ProviderResult("delivered", 200, ("m1",))


def _worker(messages, answer=DELIVERED, gate=None, jobs=None, window_s=86_400, lane="transactional", provider=None,
            producer=None, channel="email", lane_channel="email"):
    spec = replace(load_registry().primary(channel), idempotency_window_s=window_s)
    cfg = WorkerConfig(lane_channel, lane, "unused:9092", spec, NAMES)
    consumer, producer, provider = FakeConsumer(messages), producer or FakeProducer(), provider or FakeProvider(answer)
    routes = Routes([Route(spec, provider, ProviderCredentials({"*": "re_key"}))])
    worker = LaneWorker(cfg, consumer, producer, routes, gate or FakeGate(), jobs or FakeJobs(), load_policies())
    worker.consumer.subscribe([TOPIC], on_assign=worker._on_assign)
    return worker, consumer, producer, provider


def _run(worker, steps: int = 50) -> None:
    for _ in range(steps):
        worker.step()
    worker._drain()
    worker.step()


def test_delivered_sends_publish_outcomes_and_store_offsets():
    sends, msgs = _messages(["acme", "globex", "acme"])
    worker, consumer, producer, provider = _worker(msgs)
    _run(worker)
    assert len(provider.sent) == 3
    outcomes = producer.records[NAMES.outcomes]
    assert sorted(v for v, _ in outcomes) and len(outcomes) == 3
    assert consumer.stored[(TOPIC, 0)] == 3  # everything below offset 3 is done
    assert (worker.queues.buffered, worker.queues.buffered_bytes) == (0, 0)


class ClaimsSeen(FakeJobs):
    def __init__(self):
        super().__init__()
        self.claims = []

    def claim_many(self, claims):
        self.claims.extend(claims)
        return super().claim_many(claims)


def test_a_request_body_is_kept_inside_its_providers_idempotency_window():
    """Given a provider that keeps Idempotency-Keys 2 hours (providers.toml `idempotency_window = "2h"`),
    When a worker sends to it,
    Then each request's body is kept to be re-sent under its key for 23/24 of that window (1 h 55 min), not for the
    23 h a day-long window allows (a re-send after the provider forgot the key could be delivered twice)."""
    sends, msgs = _messages(["acme", "globex"])
    jobs = ClaimsSeen()
    worker, consumer, producer, provider = _worker(msgs, jobs=jobs, window_s=2 * 3600)
    _run(worker)
    assert len(provider.sent) == 2
    assert [c.record_ttl_ms for c in jobs.claims] == [115 * 60 * 1000] * 2


def test_a_throttled_tenant_waits_alone_and_pins_only_its_own_offset():
    sends, msgs = _messages(["slow", "fast", "fast"])
    worker, consumer, producer, provider = _worker(msgs, gate=FakeGate(short_tenants={"slow"}))
    _run(worker)
    assert len(provider.sent) == 2  # the fast tenant's sends went out behind the slow head
    assert consumer.stored.get((TOPIC, 0), 0) == 0  # offset 0 (slow) is unfinished: nothing past it
    assert worker.queues.buffered == 1


def test_a_tenant_denied_for_an_hour_is_asked_about_again_within_a_minute():
    """A bucket's wait can be long (an hour here; a day at a rate of one a day): the queue is held a minute at most,
    then the gate is asked again, so a limit an operator raised meanwhile applies to what the worker holds."""
    sends, msgs = _messages(["slow"])
    gate = FakeGate(short_tenants={"slow"})
    worker, consumer, producer, provider = _worker(msgs, gate=gate)
    _run(worker)
    held_for = worker.queues.queues["slow"].ready_at - time.monotonic()
    assert 55 <= held_for <= 60
    assert provider.sent == []
    # The minute over, its bucket is still dry: what arrives meanwhile is planned without a burst to let go.
    worker.queues.queues["slow"].ready_at = time.monotonic() - 1
    assert worker._burst_left("slow", 100, time.monotonic()) == 0
    gate.short_tenants.clear()
    _run(worker)
    assert len(provider.sent) == 1 and worker._burst_left("slow", 100, time.monotonic()) == 100


def test_a_permanent_rejection_is_dead_lettered_and_its_offset_finished():
    sends, msgs = _messages(["acme"])
    worker, consumer, producer, _ = _worker(msgs, answer=ProviderResult("rejected", 422, error_name="validation_error"))
    _run(worker)
    (value, headers), = producer.records[NAMES.dlq]
    assert value == msgs[0].value() and headers["reason"] == b"permanent_error"
    assert headers["send_id"] == sends[0].send_id.encode()
    assert consumer.stored[(TOPIC, 0)] == 1


def test_a_send_already_delivered_is_not_sent_again():
    sends, msgs = _messages(["acme", "acme"])
    worker, consumer, producer, provider = _worker(msgs, jobs=FakeJobs(delivered={sends[0].send_id}))
    _run(worker)
    assert provider.sent == [sends[1].send_id.encode()]
    assert consumer.stored[(TOPIC, 0)] == 2


@pytest.mark.parametrize("headers,reason", [([("attempt", b"2x")], "malformed"), ([("attempt", b"0")], "malformed"),
                                            ([("declined", b"x")], "malformed"),
                                            ([("attempt", b"2"), ("declined", b"2")], "malformed")])
def test_a_malformed_header_is_dead_lettered_not_a_crash(headers, reason):
    sends, msgs = _messages(["acme"])
    worker, consumer, producer, provider = _worker([FakeMessage(0, 0, msgs[0].value(), headers)])
    _run(worker)
    (_, dlq_headers), = producer.records[NAMES.dlq]
    assert dlq_headers["reason"] == reason.encode() and provider.sent == []
    assert consumer.stored[(TOPIC, 0)] == 1


@pytest.mark.parametrize("policy, headers, reason, payload", [
    ("no-such-policy", [], "unknown_policy", {}), ("transactional", [("attempt", b"2x")], "malformed", {}),
    ("transactional", [], "malformed", {"attachments": [{"filename": "invoice.pdf"}]})])
def test_a_send_refused_by_the_worker_is_dead_lettered_with_its_outcome(policy, headers, reason, payload):
    """Given a send a worker refuses as it reads it (routed to a policy this worker does not have, during a rollout;
    an `attempt` header it cannot read; a payload no longer accepted, published before an upgrade),
    When it is dead-lettered,
    Then its outcome event says so too, with its reason (before: only the dead letter was written, so its status
    read `accepted` for 30 days and a DLQ replay refused it as still in progress)."""
    send = build_send(validate_request(email_request()), "acme").model_copy(update={"policy": policy})
    send = send.model_copy(update={"payload": {**send.payload, **payload}})
    worker, consumer, producer, provider = _worker([FakeMessage(0, 0, encode(send), headers)])
    _run(worker)
    (_, dlq_headers), = producer.records[NAMES.dlq]
    (value, _), = producer.records[NAMES.outcomes]
    event, = events_of(orjson.loads(value))
    assert dlq_headers["reason"] == reason.encode() and provider.sent == []
    assert (event["send_id"], event["status"], event["reason"], event["attempts"]) == (send.send_id, "dead_lettered",
                                                                                       reason, 0)
    assert consumer.stored[(TOPIC, 0)] == 1


@pytest.mark.parametrize("state, attempt, outcome", [
    ("tried:1", 1, False), ("inflight:send-x", 1, False), ("delivered", 1, False), ("redis down", 1, False),
    ("tried:1", 2, True)])
def test_a_send_refused_here_that_another_worker_carries_on_keeps_its_status(state, attempt, outcome):
    """Given a send this worker refuses (a policy only newer workers have, during a rollout),
    When it reads a copy that processed_jobs says would not be sent (an attempt already made, a claim, delivered),
    or whose state cannot be read,
    Then the copy is dead-lettered without an outcome event: the send's status stays what its own chain says (a
    final `dead_lettered` would let a replay send it while that chain may still deliver it). The copy for the next
    attempt after a failed one (nothing else carries the send on) gets its outcome event: the send is dead."""
    send = build_send(validate_request(email_request()), "acme").model_copy(update={"policy": "newer-policy"})
    jobs = JobsGoingDown()
    if state == "redis down":
        jobs.down = True
    else:
        jobs.state[send.send_id] = state
    headers = [("attempt", str(attempt).encode())] if attempt > 1 else []
    worker, consumer, producer, provider = _worker([FakeMessage(0, 0, encode(send), headers)], jobs=jobs)
    _run(worker)
    (_, dlq_headers), = producer.records[NAMES.dlq]
    assert dlq_headers["reason"] == b"unknown_policy" and bool(producer.records.get(NAMES.outcomes)) == outcome
    assert consumer.stored[(TOPIC, 0)] == 1


class FlakyJobs(FakeJobs):
    """processed_jobs whose Redis fails for the first `failures` calls of the named methods."""

    def __init__(self, failures: int, methods: set[str]):
        super().__init__()
        self.failures, self.methods = failures, methods

    def __getattribute__(self, name):
        attr = super().__getattribute__(name)
        if name in super().__getattribute__("methods") and super().__getattribute__("failures") > 0:
            def failing(*args, **kwargs):
                self.failures -= 1
                raise StoreUnavailable("Redis unavailable (test)")
            return failing
        return attr


@pytest.mark.parametrize("methods", [{"status"}, {"claim"}, {"mark_delivered"}, {"release"}])
def test_redis_failing_mid_dispatch_holds_the_work_and_resumes(methods):
    """A Redis error before the provider call leaves the messages queued; after it (release, mark) the
    settlement is kept and tried again: nothing is lost and every offset is finished in the end."""
    answer = ProviderResult("rejected", 422) if methods == {"release"} else DELIVERED
    sends, msgs = _messages(["acme", "globex", "acme"])
    jobs = FlakyJobs(failures=2, methods=methods)
    worker, consumer, producer, provider = _worker(msgs, answer=answer, jobs=jobs)
    worker.redis_outage.base_s = worker.redis_outage.cap_s = 0.0  # no waiting between attempts in a unit test
    _run(worker, steps=200)
    assert jobs.failures == 0  # the failures happened
    assert consumer.stored[(TOPIC, 0)] == 3  # and every message was finished in the end
    assert worker.queues.buffered == 0 and worker.settler.pending == 0
    if answer is DELIVERED:
        assert len(provider.sent) == 3 and len(producer.records[NAMES.outcomes]) == 3
    else:
        assert len(producer.records[NAMES.dlq]) == 3


class LostClaimAnswerJobs(FakeJobs):
    """processed_jobs whose first claim is made but whose answer is lost (Redis's reply timed out)."""

    def __init__(self):
        super().__init__()
        self.lost = 1

    def claim_many(self, claims):
        answers = super().claim_many(claims)
        if self.lost:
            self.lost -= 1
            raise StoreUnavailable("claiming sends: Timeout reading from socket (test)")
        return answers


def test_a_claim_whose_answer_was_lost_is_released_and_sent_as_new_not_as_maybe_sent():
    """Given a provider without idempotency keys, and Redis whose answer to a round's claim is lost after the
    claims were made,
    When the worker holds and dispatches again,
    Then it releases those claims first (it never sent them) and sends each send once, as a fresh request: none
    is left waiting on its own lease, taken over as possibly sent or sent to reconciliation. Each tenant is charged
    for the one send that went out (before: for two, the first round's tokens left spent)."""
    sends, msgs = _messages(["acme", "globex"])
    jobs, gate = LostClaimAnswerJobs(), FakeGate()
    worker, consumer, producer, provider = _worker(msgs, jobs=jobs, gate=gate, window_s=0)
    worker.redis_outage.base_s = worker.redis_outage.cap_s = 0.0  # no waiting between attempts in a unit test
    _run(worker, steps=100)
    assert jobs.lost == 0
    assert sorted(provider.sent) == sorted(s.send_id.encode() for s in sends)
    assert {jobs.state[s.send_id] for s in sends} == {"delivered"}
    assert NAMES.dlq not in producer.records and consumer.stored[(TOPIC, 0)] == 2
    assert {k: v for k, v in gate.spent.items() if v} == {(p, t, kind): 1 for p, t, kind in gate.spent}


def test_a_lost_claim_is_released_also_by_a_held_worker_before_anything_reads_its_sends():
    """Given a claim round whose answer Redis lost, after which the worker is held (its provider not ready; a
    yielding marketing lane is held the same way),
    When the worker steps on while held,
    Then the claims are released all the same (their sends free again), not left to lapse and be taken over as
    possibly sent by whoever meets them."""
    sends, msgs = _messages(["acme", "globex"])
    jobs = LostClaimAnswerJobs()
    worker, consumer, producer, provider = _worker(msgs, jobs=jobs, window_s=0)
    worker.redis_outage.base_s = worker.redis_outage.cap_s = 0.0
    for _ in range(5):
        worker.step()
        if jobs.lost == 0:
            break
    assert jobs.lost == 0 and any(v.startswith("inflight:") for v in jobs.state.values())
    provider.ready = False
    worker.step()
    assert not any(v.startswith("inflight:") for v in jobs.state.values()) and provider.sent == []


class RacedThenLostJobs(FakeJobs):
    """processed_jobs where a racing worker claims one send of a batch between the batch's state read and its
    claim, and the claim of the rest (made again without it) is made but its answer lost."""

    def __init__(self, raced: str):
        super().__init__()
        self.raced, self.lost = raced, 1

    def claim_many(self, claims):
        if any(self.raced in c.send_ids and len(c.send_ids) > 1 for c in claims):
            self.state[self.raced] = "inflight:another-workers-request"
        answers = super().claim_many(claims)
        if self.lost and len(claims) == 1 and self.raced not in claims[0].send_ids:
            self.lost -= 1
            raise StoreUnavailable("claiming sends: Timeout reading from socket (test)")
        return answers


def test_the_claim_of_a_batch_made_again_without_a_raced_send_is_released_when_its_answer_is_lost():
    """Given a marketing batch of two sends, one of which a racing worker holds, and Redis whose answer to the
    claim of the other (made again without the raced one) is lost after it was made,
    When the worker goes on,
    Then that claim is released and its send delivered once, as a fresh request (before: it was left claimed by
    this worker, and taken over as possibly sent once its lease lapsed)."""
    sends, msgs = _messages(["acme", "acme"])
    jobs = RacedThenLostJobs(raced=sends[0].send_id)
    worker, consumer, producer, provider = _worker(msgs, jobs=jobs, window_s=0, lane="marketing")
    worker.redis_outage.base_s = worker.redis_outage.cap_s = 0.0
    wait_until(lambda: worker.step() or provider.sent, 10, "the send not raced to be sent")  # the raced one holds 0.5 s
    _run(worker, steps=10)  # its answer settled
    assert jobs.lost == 0
    assert provider.sent == [sends[1].send_id.encode()] and jobs.state[sends[1].send_id] == "delivered"


@pytest.mark.parametrize("answer, then", [
    (ProviderResult("rejected", 422, error_name="validation_error",
                    error_body=redact("Invalid `to`: jane@example.com"), latency_s=0.05), "dead_lettered"),
    (ProviderResult("unavailable", error_name="ConnectError", latency_s=3.0), "retry_scheduled"),
    (ProviderResult("unknown", error_name="ReadTimeout", latency_s=2.0), "retry_scheduled"),
])
def test_every_failed_attempt_leaves_evidence_without_personal_data(answer, then, caplog):
    """One line per failed attempt (send id, provider, status or error class, duration, redacted body) and one
    per retry scheduled or dead letter; the address in the provider's answer never reaches the log."""
    sends, msgs = _messages(["acme"])
    worker, *_ = _worker(msgs, answer=answer)
    with caplog.at_level("WARNING"):
        _run(worker)
    lines = [r.getMessage() for r in caplog.records]
    [failed] = [m for m in lines if m.startswith("attempt_failed")]
    assert f"send_id={sends[0].send_id}" in failed and "provider=resend" in failed
    assert f"error={answer.error_name}" in failed and "duration_s=" in failed
    assert [m for m in lines if m.startswith(then)] and not any("jane" in m for m in lines)


def test_a_webhook_receivers_answer_never_reaches_our_logs(caplog):
    """Given a webhook receiver (the tenant's own server) answering 500 with the event it got echoed back,
    When the attempt fails,
    Then the log line says what failed (status, error, duration) without the answer's body: a person's name and
    street, which no redaction recognises, stay out of our logs, and out of the attempt event (the attempts topic is
    kept 30 days, longer than payloads; nothing read it). A provider's answer is still logged, redacted."""
    echo = ProviderResult("unavailable", 500, error_name="http_500", error_body='echo {"name": "Jane Roe"}')
    request = webhook_event()
    request["payload"] = {**request["payload"], "event_id": "ev_1", "endpoint_id": "ep_1"}
    msgs = [FakeMessage(0, 0, encode(build_send(validate_request(request), "acme")))]
    worker, _, producer, _ = _worker(msgs, answer=echo, channel="webhook", lane_channel="webhook")
    with caplog.at_level("WARNING"):
        _run(worker)
    [failed] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("attempt_failed")]
    assert "status=500" in failed and "error=http_500" in failed and "provider=webhook" in failed
    assert "Jane" not in failed and "body=" not in failed
    attempts = [value for topic, records in producer.records.items() if topic.endswith("attempts")
                for value, _ in records]
    assert attempts and not any(b"Jane" in value for value in attempts), attempts


def test_a_tenant_over_its_share_of_the_buffer_is_parked_not_held():
    """A tenant throttled to 5/s with a burst of 5 may hold what its bucket lets go within 5 s (the horizon here):
    its burst and 5 s of its rate, 30 messages. The rest is parked on a retry tier, due back in turn, without
    using up an attempt, so the partition's offset moves on."""
    sends, msgs = _messages(["slow"] * 60 + ["fast"] * 5)
    worker, consumer, producer, provider = _worker(msgs, gate=FakeGate(rates={"slow": 5}, bursts={"slow": 5}))
    worker.backlog = BacklogShare(horizon_s=5)
    _run(worker)
    parked = [h for topic, records in producer.records.items() if ".retry." in topic for _, h in records]
    assert len(parked) == 30
    assert all(h["spilled"] == b"1" and h["attempt"] == b"1" for h in parked)
    dues = [int(h["due_at_ms"]) for h in parked]
    assert dues == sorted(dues) and dues[-1] - dues[0] >= 29 / 5 * 1000 - 50  # one turn (1/5 s) apart
    assert len(provider.sent) == 35  # the 30 kept and the other tenant's 5
    assert consumer.stored[(TOPIC, 0)] == 65


def test_a_tenant_parked_past_its_sends_max_age_is_due_back_by_its_max_age():
    """Given a tenant throttled to 1 message an hour whose transactional sends (max age 2 h) fill its share,
    When more arrive and are parked on a retry tier, their turns days away,
    Then each is due back no later than its send's max age (before: due when its turn came, days later, on a
    tier that keeps a copy 7 days: a long enough queue was deleted by retention before its release, with no
    dead letter); those whose turn is past it are due at exactly their max age."""
    sends, msgs = _messages(["slow"] * 12)
    worker, consumer, producer, provider = _worker(msgs, gate=FakeGate(rates={"slow": 1 / 3600},
                                                                       bursts={"slow": 1}))
    worker.backlog = BacklogShare(horizon_s=5)
    _run(worker)
    parked = [h for topic, records in producer.records.items() if ".retry." in topic for _, h in records]
    max_age_ms = worker.settler.policies[sends[0].policy].max_age_s * 1000
    created = {s.send_id.encode(): s.created_at_ms for s in sends}
    assert parked and all(int(h["due_at_ms"]) <= created[h["send_id"]] + max_age_ms for h in parked)
    assert max(int(h["due_at_ms"]) - created[h["send_id"]] for h in parked) == max_age_ms  # turns 3 h on: capped

    # Back at its max age, still behind its turn: dead-lettered too_old, not parked again (and again).
    last = max(parked, key=lambda h: int(h["due_at_ms"]))
    [back] = [s for s in sends if s.send_id.encode() == last["send_id"]]
    before = sum(len(records) for topic, records in producer.records.items() if ".retry." in topic)
    old = back.model_copy(update={"created_at_ms": back.created_at_ms - max_age_ms})  # as when it comes back
    consumer.pending.append(FakeMessage(0, 12, encode(old), list(last.items())))
    _run(worker)
    assert sum(len(records) for topic, records in producer.records.items() if ".retry." in topic) == before
    assert [h["reason"] for _, h in producer.records[NAMES.dlq]] == [b"too_old"]


def test_a_transactional_tenant_above_its_rate_holds_one_second_of_it_and_its_burst_only_until_it_waits():
    """The transactional lane's horizon is 1 s: marketing yields on that lane's committed lag, which counts the
    partition's whole inflow behind the first message a tenant holds. A burst within the tenant's bucket is kept
    (parking it would delay sends its bucket lets go at once); once the tenant waits on its bucket, only a second
    of its rate is."""
    gate = FakeGate(rates={"pumper": 5}, bursts={"pumper": 10})
    sends, msgs = _messages(["pumper"] * 40)
    worker, consumer, producer, provider = _worker(msgs, gate=gate)
    worker.backlog = BacklogShare(HORIZON_S["transactional"])
    worker.step()
    parked = [h for topic, records in producer.records.items() if ".retry." in topic for _, h in records]
    assert len(parked) == 40 - 15  # kept: its burst (10) and 1 s of its rate (5)

    worker.queues.hold("pumper", time.monotonic() + 60)  # its bucket ran dry: the gate holds its queue
    consumer.pending.extend(FakeMessage(0, 40 + i, encode(build_send(validate_request(email_request()), "pumper")))
                             for i in range(10))
    held = worker.queues.size("pumper")
    worker.step()
    assert worker.queues.size("pumper") == max(held, 5)  # nothing more kept while it waits: 1 s of its rate


class DryBucketGate(FakeGate):
    """Denies `dry` tenants as a dry bucket does: their next token 12 s away."""

    def acquire(self, provider, tenant, messages, reserve=False):
        if tenant in self.short_tenants:
            return Admission(False, 12.0, "tenant")
        return super().acquire(provider, tenant, messages, reserve)


def test_a_transactional_tenant_limited_to_a_few_a_minute_does_not_pin_the_partitions_offset():
    """Given a transactional tenant limited to 5 a minute whose bucket is dry (its next token 12 s away), one OTP of
    it, then 300 of other tenants on the same partition,
    When the worker runs,
    Then the others are sent, the tenant's OTP is parked for its turn (due in about 12 s), and the partition's
    offset moves past all 301 (before: the OTP was held as the tenant's one request, its offset pinned 12 s, the
    partition's whole inflow counted as transactional lag meanwhile: marketing yielded for every tenant)."""
    gate = DryBucketGate(short_tenants={"slow"}, rates={"slow": 5 / 60}, bursts={"slow": 5})
    sends, msgs = _messages(["slow"] + [f"t{i % 30}" for i in range(300)])
    worker, consumer, producer, provider = _worker(msgs, gate=gate)
    worker.backlog, worker.trim_every_s = BacklogShare(HORIZON_S["transactional"]), 0.0
    before_ms = time.time() * 1000
    _run(worker)
    parked = [h for topic, records in producer.records.items() if ".retry." in topic for _, h in records]
    assert [h["send_id"] for h in parked] == [sends[0].send_id.encode()]
    assert before_ms + 11_000 <= int(parked[0]["due_at_ms"]) <= time.time() * 1000 + 12_000
    assert len(provider.sent) == 300 and consumer.stored[(TOPIC, 0)] == 301


def test_a_webhook_tenants_endpoints_share_one_tenants_share_of_the_buffer():
    """Given a webhook tenant at 10 deliveries a second (a burst of 10) fanning 100 events out to each of its 30
    endpoints, whose bucket is dry,
    When the worker takes the 3,000 deliveries in,
    Then it holds about one share of the tenant's (its burst and 10 s of its rate: 110) and parks the rest (before:
    each endpoint's queue was measured against the whole share: all 3,000 held, the buffer filled, and every
    partition paused for every tenant until this one's own rate had worked through them)."""
    from streams.dispatch.tenant_queues import by_endpoint

    sends = []
    for n in range(3000):
        request = webhook_event()
        request["payload"] = {**request["payload"], "event_id": f"ev_{n // 30}", "endpoint_id": f"ep_{n % 30}"}
        sends.append(build_send(validate_request(request), "acme"))
    msgs = [FakeMessage(0, i, encode(s)) for i, s in enumerate(sends)]
    gate = FakeGate(short_tenants={"acme"}, rates={"acme": 10}, bursts={"acme": 10})
    worker, consumer, producer, provider = _worker(msgs, gate=gate, channel="webhook", lane_channel="webhook",
                                                   lane="marketing")
    worker.queues.queue_key = by_endpoint
    worker.backlog = BacklogShare(horizon_s=10)
    while consumer.pending:
        worker.step()
    parked = [h for topic, records in producer.records.items() if ".retry." in topic for _, h in records]
    assert 100 <= worker.queues.buffered <= 110 and len(parked) == 3000 - worker.queues.buffered
    assert len(worker.queues.queues) > 1  # held over several endpoints' queues


def test_a_tenant_that_holds_nothing_still_asks_the_gate_once_its_hold_passes_and_waits_out_a_long_one():
    """Given a transactional tenant at 1 every 2 s denied for an hour (its queue held a minute, its bucket said
    dry for the hour), whose message was parked,
    When an operator raises its limit, the minute passes and an OTP of it arrives,
    Then that OTP asks the gate and is sent (before: a tenant holding nothing parked everything until the hour's
    end, its OTPs dead-lettered `too_old`); and under a long hold (a 10-minute Retry-After) an arriving OTP is
    parked until the hold ends, not due in 2 s to come straight back and go round the tier."""
    gate = FakeGate(short_tenants={"slow"}, rates={"slow": 0.5}, bursts={"slow": 1})
    sends, msgs = _messages(["slow"] * 3)
    worker, consumer, producer, provider = _worker(msgs[:1], gate=gate)
    worker.backlog, worker.trim_every_s = BacklogShare(HORIZON_S["transactional"]), 0.0
    _run(worker)
    retried = lambda: [h for t, records in producer.records.items() if ".retry." in t for _, h in records]  # noqa: E731
    assert len(retried()) == 1 and provider.sent == []  # asked, denied, then parked
    gate.short_tenants.clear()
    worker.queues.queues["slow"].ready_at = time.monotonic() - 1  # the minute passed; the bucket "dry" an hour
    consumer.pending.append(msgs[1])
    _run(worker)
    assert provider.sent == [sends[1].send_id.encode()]

    now_ms = int(time.time() * 1000)
    worker.settler.hold_long("slow", 600, "endpoint_retry_after")
    consumer.pending.append(msgs[2])
    _run(worker)
    assert int(retried()[-1]["due_at_ms"]) >= now_ms + 599_000 and len(provider.sent) == 1


def test_what_arrives_under_a_long_hold_is_parked_in_turns_from_the_holds_end():
    """Given a transactional tenant at 1 every 2 s under a 10-minute hold (a Retry-After),
    When three OTPs of it arrive,
    Then they are parked due at the hold's end and then one turn (2 s) apart (before: all three due at the hold's
    end, two of them back only to be parked again)."""
    gate = FakeGate(rates={"slow": 0.5}, bursts={"slow": 1})
    sends, msgs = _messages(["slow"] * 3)
    worker, consumer, producer, provider = _worker([], gate=gate)
    worker.backlog = BacklogShare(HORIZON_S["transactional"])
    _run(worker)
    now_ms = int(time.time() * 1000)
    worker.settler.hold_long("slow", 600, "endpoint_retry_after")
    consumer.pending.extend(msgs)
    _run(worker)
    dues = sorted(int(h["due_at_ms"]) for t, records in producer.records.items() if ".retry." in t for _, h in records)
    assert len(dues) == 3 and provider.sent == []
    assert dues[0] >= now_ms + 599_000
    assert all(later - earlier >= 1_900 for earlier, later in itertools.pairwise(dues)), dues


def test_a_transactional_tenants_burst_within_its_bucket_is_never_parked():
    gate = FakeGate(rates={"acme": 1}, bursts={"acme": 20})
    sends, msgs = _messages(["acme"] * 20)
    worker, consumer, producer, provider = _worker(msgs, gate=gate)
    worker.backlog = BacklogShare(HORIZON_S["transactional"])
    _run(worker)
    assert not [topic for topic in producer.records if ".retry." in topic]
    assert len(provider.sent) == 20


class DownGate(FakeGate):
    """A gate whose Redis is down while `down` is set (every call refused); counts the limit reads."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.down, self.limit_reads = True, 0

    def tenant_limit(self, provider, tenant):
        self.limit_reads += 1
        if self.down:
            raise StoreUnavailable("Redis down")
        return super().tenant_limit(provider, tenant)

    def acquire_many(self, requests):
        if self.down:
            raise StoreUnavailable("Redis down")
        return super().acquire_many(requests)


def test_while_redis_is_down_intake_asks_for_a_tenants_limit_once_per_back_off_not_per_message():
    """A hanging Redis costs each call its timeout: 500 messages asking it one by one would block the poll loop
    for minutes (past max.poll.interval.ms). Intake follows the dispatch's Redis back-off instead."""
    sends, msgs = _messages(["acme"] * 500)
    gate = DownGate()
    worker, *_ = _worker(msgs, gate=gate)
    worker.backlog = BacklogShare()
    # A back-off no intake outlasts (the first is 0.125-0.25 s: a slow machine took in 500 messages in more)
    worker.redis_outage.base_s = worker.redis_outage.cap_s = 60.0
    worker.step()
    assert worker.queues.buffered == 500  # kept, as before: nothing to plan with
    assert gate.limit_reads == 1


def test_a_queue_grown_past_its_share_while_redis_was_down_is_trimmed_once_it_is_back():
    """Messages that arrived while the tenant's limit could not be read were all kept; once Redis answers, what
    the tenant holds past its share (a burst of 5 and 5/s over a 5 s horizon: 30) is parked on a retry tier, so the
    worker's buffer and the partition's offset are not held until the tenant's own rate works through it."""
    sends, msgs = _messages(["slow"] * 300)
    gate = DownGate(rates={"slow": 5}, bursts={"slow": 5})
    worker, consumer, producer, provider = _worker(msgs, gate=gate)
    worker.backlog, worker.trim_every_s = BacklogShare(horizon_s=5), 0.0
    worker.step()
    assert worker.queues.buffered == 300 and provider.sent == []
    gate.down = False
    worker.redis_outage.recovered(time.monotonic())
    _run(worker)
    parked = [h for topic, records in producer.records.items() if ".retry." in topic for _, h in records]
    assert len(parked) == 270 and all(h["spilled"] == b"1" and h["attempt"] == b"1" for h in parked)
    assert len(provider.sent) == 30
    assert consumer.stored[(TOPIC, 0)] == 300


class RevokingConsumer(FakeConsumer):
    """Revokes partition 1 in the consume that follows the poll (as librdkafka serves a rebalance there),
    after the poll has returned a message of that partition."""

    def __init__(self, messages, worker_of):
        super().__init__(messages)
        self.worker_of, self.revoked = worker_of, False

    def consume(self, num_messages=1, timeout=0):
        if num_messages > 1 and not self.revoked and self.on_assign is None:
            self.revoked = True
            self.worker_of()._on_revoke(self, [_TP(TOPIC, 1)])
        return super().consume(num_messages, timeout)


def test_a_message_of_a_partition_revoked_after_the_poll_returned_it_is_left_to_its_new_owner():
    """Taken in, it would be sent by this worker as well as by the partition's new owner, and its offset would
    bring the partition's tracking back here, below what the new owner commits."""
    sends = [build_send(validate_request(email_request()), "acme") for _ in range(2)]
    msgs = [FakeMessage(1, 40, encode(sends[0])), FakeMessage(0, 0, encode(sends[1]))]
    holder: list = []
    consumer = RevokingConsumer(msgs, lambda: holder[0])
    spec = load_registry().primary("email")
    provider = FakeProvider(DELIVERED)
    worker = LaneWorker(WorkerConfig("email", "transactional", "unused:9092", spec, NAMES), consumer,
                        FakeProducer(), Routes([Route(spec, provider, ProviderCredentials({"*": "re_key"}))]),
                        FakeGate(), FakeJobs(), load_policies())
    holder.append(worker)
    worker.consumer.subscribe([TOPIC], on_assign=worker._on_assign)
    consumer.poll()  # the assignment (the fake assigns on its first call)
    consumer.pending = msgs
    _run(worker)
    assert consumer.revoked
    assert len(provider.sent) == 1 and sends[0].send_id.encode() not in provider.sent[0]
    assert (TOPIC, 1) not in worker.tracker.committable() and (TOPIC, 1) not in consumer.stored


class CoolingGate(FakeGate):
    """The provider's account cools down (a 429 with Retry-After seen by another worker: an hour by default)."""

    def __init__(self, seconds: float = 3600.0):
        super().__init__()
        self.seconds = seconds

    def acquire(self, provider, tenant, messages, reserve=False):
        return Admission(False, self.seconds, "cooldown")


def _cool_down_holds(seconds: float) -> list[float]:
    """How long a worker held its dispatch on each of 20 denials by a cool-down of `seconds`."""
    sends, msgs = _messages(["acme"] * 3)
    worker, *_ = _worker(msgs, gate=CoolingGate(seconds))
    worker.step()  # takes the sends in; the gate answers with the cool-down
    holds, route = [], worker.dispatcher.routes.primary
    for _ in range(20):
        route.shared_account_held_until = 0.0
        before = time.monotonic()
        worker.dispatcher.dispatch()
        holds.append(route.shared_account_held_until - before)
    return holds


def test_a_cool_down_ends_at_most_a_second_late_and_a_long_one_is_asked_again_every_few_seconds():
    """Workers leave a shared cool-down at jittered moments, not all at once (the jitter was once a fifth of the
    whole wait: an hour's cool-down idled every worker up to 12 minutes past its end). A long one (a quota 429's
    Retry-After of an hour) is asked again every COOL_DOWN_RECHECK_S: an operator who ended it (`streams limits
    clear-cooldown`, the quota raised) is heard within seconds (before, every worker held for the whole hour)."""
    short = _cool_down_holds(5.0)
    assert all(5.0 <= hold <= 6.1 for hold in short) and len(set(short)) > 1
    assert COOL_DOWN_RECHECK_S <= 10 and all(hold <= 10.1 for hold in _cool_down_holds(3600.0))
    # The re-check before the last 10 s leaves them whole, so that the end is left at a jittered moment too.
    assert all(4.9 <= hold <= 5.01 for hold in _cool_down_holds(15.0))


class OneBrokenBucketGate(FakeGate):
    """Tenant "broken"'s buckets are held by Redis in a shape the gate's script cannot read."""

    def acquire(self, provider, tenant, messages, reserve=False):
        if tenant == "broken":
            raise BucketUnreadable(f"the buckets of provider {provider!r} for tenant 'broken' cannot be read")
        return super().acquire(provider, tenant, messages, reserve)

    def acquire_many(self, requests):
        return [BucketUnreadable("unreadable") if r[1] == "broken" else self.acquire(*r) for r in requests]


class OneUnlimitedTenantGate(FakeGate):
    """Tenant "broken" has no limit left (removed after its request was claimed), and no default ('*')."""

    def acquire(self, provider, tenant, messages, reserve=False):
        if tenant == "broken":
            raise ConfigError(f"no rate limits configured for provider {provider!r} (or tenant 'broken')")
        return super().acquire(provider, tenant, messages, reserve)


@pytest.mark.parametrize("gate", [OneBrokenBucketGate, OneUnlimitedTenantGate], ids=["unreadable", "no limit"])
def test_a_tenant_whose_buckets_cannot_be_read_is_held_alone_also_when_its_request_is_re_sent(gate):
    """Tenant "broken"'s request met an unknown outcome and is taken over for a re-send, which asks the gate
    alone; its buckets cannot be read, or it has no limit any more. Before, the first error failed the whole
    dispatch round like a Redis outage (every tenant back to its queue, the outage back-off, round after round),
    and the second left the worker's step (the worker stopped, and again after every restart); now "broken" is
    held and "acme" is sent."""
    sends, msgs = _messages(["broken", "acme"])
    jobs = RecordingJobs()
    jobs.claim([sends[0].send_id], f"send-{sends[0].send_id}", "dead-worker", "/emails", b"the body", "broken", "")
    worker, consumer, producer, provider = _worker(msgs, gate=gate(), jobs=jobs)
    _run(worker, steps=5)
    assert [body for body in provider.sent if b"the body" in body] == []
    assert len(provider.sent) == 1 and sends[1].send_id.encode() in provider.sent[0]
    assert not worker.redis_outage.active


def test_a_send_older_than_its_policy_allows_is_dead_lettered_before_any_attempt():
    """The age is checked before every attempt: a 10-minute OTP found two hours late is never sent."""
    old = build_send(validate_request({**email_request(), "template_id": "otp"}), "acme",
                     now_ms=int(time.time() * 1000) - 2 * 3600 * 1000)
    worker, consumer, producer, provider = _worker([FakeMessage(0, 0, encode(old))])
    _run(worker)
    assert provider.sent == []
    (_, headers), = producer.records[NAMES.dlq]
    assert headers["reason"] == b"too_old" and consumer.stored[(TOPIC, 0)] == 1


def test_a_too_old_copy_released_again_is_not_dead_lettered_twice():
    """Given a retry copy of an email for its attempt 3, found past its max age and dead-lettered `too_old`,
    When the same copy is released again (a retrier restarted behind a copy due days ahead reads it again),
    Then it is skipped as stale: one dead letter, one `dead_lettered` outcome (before: a second of each at every
    re-release, and DeadLettersGrowing fired after retrier restarts)."""
    old = build_send(validate_request(email_request()), "acme", now_ms=int(time.time() * 1000) - 30 * 86_400_000)
    copy = [("attempt", b"3")]
    worker, consumer, producer, provider = _worker([FakeMessage(0, 0, encode(old), copy)])
    _run(worker)
    consumer.pending.append(FakeMessage(0, 1, encode(old), copy))
    _run(worker)
    assert provider.sent == [] and len(producer.records[NAMES.dlq]) == 1
    assert [orjson.loads(v)["status"] for v, _ in producer.records[NAMES.outcomes]] == ["dead_lettered"]
    assert consumer.stored[(TOPIC, 0)] == 2


def test_short_429s_waited_out_in_the_worker_do_not_use_up_attempts():
    """A run of short 429s (the provider never looked at the send) must not exhaust a transactional send's
    attempts, nor its tenant's bucket: it is delivered as attempt 1, without ever reaching a retry tier, and
    charged to its tenant once."""
    sends, msgs = _messages(["acme"])
    gate = FakeGate()
    worker, consumer, producer, provider = _worker(msgs, gate=gate)
    answers = [ProviderResult("throttled", 429, retry_after="0", error_name="rate_limit_exceeded")] * 8 + [DELIVERED]
    provider.post = lambda *args: (provider.sent.append(args[1]), answers.pop(0))[1]
    _run(worker, steps=100)
    assert len(provider.sent) == 9 and not any(".retry." in t for t in producer.records)
    [(event, _)] = producer.records[NAMES.outcomes][-1:]
    assert orjson.loads(event)["status"] == "delivered" and orjson.loads(event)["attempts"] == 1
    # acme's bucket is charged once for the email (before: nine times, its day's limit spent by the provider's
    # throttling of everyone); the shared account's requests were all made
    assert (gate.spent[("resend", "acme", "messages")], gate.spent[("resend", "acme", "requests")]) == (1, 9)


@pytest.mark.parametrize("answer, spent", [
    (ProviderResult("unavailable", error_name="connect_error", never_sent=True), (0, 0)),
    (ProviderResult("unavailable", 503, error_name="http_503"), (1, 1)),
], ids=["never reached the provider", "answered 503"])
def test_a_request_that_never_reached_the_provider_gives_its_tokens_back(answer, spent):
    """Given an email whose request fails without reaching the provider (no connection could be made),
    When it is settled (copied to a retry tier),
    Then its tenant's bucket and the shared account's get their tokens back (before: every retry of a network
    outage was charged, and a tenant limited to 500 a day found its day spent on requests never made); a request
    the provider answered (503) stays charged."""
    sends, msgs = _messages(["acme"])
    gate = FakeGate()
    worker, consumer, producer, provider = _worker(msgs, answer=answer, gate=gate)
    _run(worker)
    assert any(".retry." in t for t in producer.records)
    assert (gate.spent[("resend", "acme", "messages")], gate.spent[("resend", "acme", "requests")]) == spent


@pytest.mark.parametrize("held_for_ms, held", [(None, True), (0, False)], ids=["within 60 s", "past it"])
def test_a_receivers_short_429s_are_announced_held_until_they_have_lasted_a_minute(monkeypatch, held_for_ms, held):
    """Given a webhook receiver answering 429 with Retry-After: 0 three times, then 200,
    When the worker waits each out and tries the same attempt again,
    Then each 429's attempt event says `held` (endpoint health does not count it) while the receiver has asked to
    wait for less than a minute, and not once it has asked for longer (each then counts: a receiver that never
    stops asking is degraded rather than holding its deliveries in the worker); the delivery is attempt 1."""
    if held_for_ms is not None:
        monkeypatch.setattr(settle_module, "HELD_UNCOUNTED_MS", held_for_ms)
    request = webhook_event()
    request["payload"] = {**request["payload"], "event_id": "ev_1", "endpoint_id": "ep_1"}
    send = build_send(validate_request(request), "acme")
    worker, consumer, producer, provider = _worker([FakeMessage(0, 0, encode(send))], channel="webhook",
                                                   lane_channel="webhook")
    answers = [ProviderResult("throttled", 429, retry_after="0", error_name="http_429")] * 3 + [DELIVERED]
    provider.post = lambda *args: (provider.sent.append(args[1]), answers.pop(0))[1]
    deadline = time.monotonic() + 10  # each 429 holds the endpoint's queue for the default second
    while answers and time.monotonic() < deadline:
        worker.step()
    _run(worker)
    attempts = [orjson.loads(v) for v, _ in producer.records[NAMES.webhook_attempts]]
    assert [(a["outcome"], a["held"], a["n"]) for a in attempts] == [("throttled", held, 1)] * 3 + [
        ("delivered", False, 1)]


def test_an_unknown_outcome_at_a_provider_without_idempotency_keys_goes_to_reconciliation():
    """Without idempotency keys a re-send could deliver twice: the send is dead-lettered `unknown_outcome` and
    marked for reconciliation, so nothing sends it again by itself."""
    sends, msgs = _messages(["acme"])
    jobs = FakeJobs()
    worker, consumer, producer, provider = _worker(msgs, answer=ProviderResult("unknown", error_name="ReadTimeout"),
                                                   jobs=jobs, window_s=0)
    _run(worker)
    (_, headers), = producer.records[NAMES.dlq]
    assert headers["reason"] == b"unknown_outcome" and jobs.state[sends[0].send_id] == "reconcile"


class RecordingJobs(FakeJobs):
    """FakeJobs that keeps each claimed request's record, so a later attempt can take it over (the
    holder's lease is taken as lapsed at once)."""

    def __init__(self):
        super().__init__()
        self.records: dict[str, StoredRequest] = {}

    def claim(self, send_ids, key, owner, path, body, tenant, provider="", attempts=None, account=""):
        busy = super().claim(send_ids, key, owner, path, body, tenant, provider)
        if not busy:
            self.records[key] = StoredRequest(key, path, body, tenant, tuple(sorted(send_ids)), provider,
                                              dict(attempts or {}), account)
        return busy

    def take_over(self, tenant, key, owner, send_ids=()): return self.records.get(key)

    def note_attempts(self, noted):
        for _, key, send_id, attempt in noted:
            if key in self.records:
                live = self.records[key].attempts
                live[send_id] = max(attempt, live.get(send_id, 0))

    def release(self, tenant, send_ids, key, owner, earlier=None):
        self.records.pop(key, None)
        return super().release(tenant, send_ids, key, owner, earlier)


class KeyedProvider(FakeProvider):
    """A provider that honours idempotency keys: a key it accepted before is answered from its store.
    `answers` come first, in order ("accept, answer lost" or an answer given without accepting)."""

    LOST = "accepted, answer lost"
    FAILED_AFTER = "accepted, then answered 500"
    READ_THEN_REFUSED = "accepted, its connection closed unanswered; the next answer is its second copy's"

    def __init__(self, answers):
        super().__init__(DELIVERED)
        self.answers = list(answers)
        self.keys: list[str] = []
        self.accepted: dict[str, bytes] = {}  # idempotency key -> the body it delivered

    def build(self, messages, batch):
        return "/emails/batch", b"|".join(sorted(m.send_id.encode() for m in messages))

    def post(self, path, body, api_key, idempotency_key):
        self.keys.append(idempotency_key)
        answer = self.answers.pop(0) if self.answers else DELIVERED
        if answer is self.LOST or answer is self.FAILED_AFTER or answer is DELIVERED or answer is self.READ_THEN_REFUSED:
            self.accepted.setdefault(idempotency_key, body)
        if answer is self.READ_THEN_REFUSED:  # the adapter sends it again at once, under the same key
            self.keys.append(idempotency_key)
            answer = self.answers.pop(0)
        if answer is self.LOST:
            return ProviderResult("unknown", 502, error_name="bad_gateway")
        if answer is self.FAILED_AFTER:  # as the HTTP adapter maps it
            return ProviderResult(classify(500, "internal_server_error"), 500, error_name="internal_server_error")
        return answer

    def deliveries(self) -> dict[bytes, int]:
        counts: dict[bytes, int] = defaultdict(int)
        for body in self.accepted.values():
            for send_id in body.split(b"|"):
                counts[send_id] += 1
        return dict(counts)


@pytest.mark.parametrize("refusal", [
    ProviderResult("throttled", 429, retry_after="0", error_name="rate_limit_exceeded"),
    ProviderResult("unavailable", error_name="connection_refused"),
], ids=["429", "connection refused"])
def test_a_resent_request_that_fails_keeps_its_sends_claimed_under_its_key(refusal):
    """Given a batch of three marketing emails the provider accepted but whose answer was lost (502),
    When the first retry copy back re-sends the request under its key and that re-send is refused
    before the provider looks at the key (a 429, a refused connection), and every copy comes back,
    Then the sends stay claimed under the first key: every request the provider sees carries that key,
    and each email is delivered once (a release would re-batch them under a new key: twice)."""
    sends, msgs = _messages(["acme"] * 3)
    provider = KeyedProvider([KeyedProvider.LOST, refusal])
    worker, consumer, producer, _ = _worker(msgs, jobs=RecordingJobs(), lane="marketing", provider=provider)
    _run(worker)
    retry_topic, = (t for t in producer.records if ".retry." in t)
    assert len(producer.records[retry_topic]) == 3 and len(provider.keys) == 1
    returned = 0
    while returned < len(producer.records[retry_topic]):  # the retrier brings each copy back, one at a time
        value, headers = producer.records[retry_topic][returned]
        consumer.pending.append(FakeMessage(0, 3 + returned, value, list(headers.items())))
        returned += 1
        _run(worker)
    assert set(provider.keys) == {provider.keys[0]} and len(provider.keys) >= 3, provider.keys
    assert provider.deliveries() == {s.send_id.encode(): 1 for s in sends}


def _orphaned_request(attempt: int = 1):
    """A send claimed by a request whose sender died (its outcome unknown, its lease lapsed), claimed for `attempt`."""
    send = build_send(validate_request(email_request()), "acme")
    jobs = RecordingJobs()
    key = idempotency_key([send.send_id])
    jobs.state[send.send_id] = f"inflight:{key}"
    jobs.records[key] = StoredRequest(key, "/emails", send.send_id.encode(), "acme", (send.send_id,), "",
                                      {send.send_id: attempt} if attempt > 1 else {})
    return send, jobs, key


class UnansweredProvider(FakeProvider):
    """A provider whose answers wait until `answer_next()`: requests stay in flight meanwhile."""

    def __init__(self):
        super().__init__(DELIVERED)
        self.waiting: list[Future] = []

    def submit(self, path, body, api_key, idempotency_key, tenant):
        self.sent.append(body)
        self.waiting.append(Future())
        return self.waiting[-1]

    def answer_next(self):
        self.waiting.pop(0).set_result(DELIVERED)


@pytest.mark.parametrize("fresh", [0, 1], ids=["kept only", "beside a fresh send"])
def test_re_sends_of_kept_requests_keep_to_the_workers_concurrency(fresh):
    """Given three of acme's marketing sends, each claimed by its own request whose sender died (outcomes unknown),
    read again together by a worker allowed one request in flight (--concurrency 1), alone or after a fresh send of
    acme's (drawn in the same round),
    When it sends them (the kept ones re-sent under their keys),
    Then it has one request in flight at a time, the others sent as each answer comes (before: every kept one at
    once, whatever the worker's concurrency or the provider's pacing, and the fresh one's request beside them),
    each once."""
    sends = [build_send(validate_request(email_request()), "acme") for _ in range(3 + fresh)]
    jobs = RecordingJobs()
    for send in sends[fresh:]:
        key = idempotency_key([send.send_id])
        jobs.state[send.send_id] = f"inflight:{key}"
        jobs.records[key] = StoredRequest(key, "/emails", send.send_id.encode(), "acme", (send.send_id,), "", {})
    provider = UnansweredProvider()
    worker, consumer, producer, _ = _worker([FakeMessage(0, i, encode(s)) for i, s in enumerate(sends)], jobs=jobs,
                                            provider=provider, lane="marketing")
    worker.dispatcher.concurrency = 1
    for answered in range(len(sends)):
        deadline = time.monotonic() + 10
        while len(provider.sent) == answered and time.monotonic() < deadline:  # a held copy is looked at again in 1 s
            worker.step()
            assert len(worker.dispatcher.in_flight) <= 1
        assert len(provider.sent) == answered + 1
        provider.answer_next()
    _run(worker)
    assert sorted(provider.sent) == sorted(s.send_id.encode() for s in sends)
    assert {jobs.state[s.send_id] for s in sends} == {"delivered"} and consumer.stored[(TOPIC, 0)] == len(sends)


def test_redis_failing_as_a_request_is_left_to_reconciliation_loses_no_queued_copy_of_its_sends():
    """Given a send whose request's sender died (its outcome unknown) at a provider without idempotency keys, and its
    lane message and retry copy both read again by the next worker, which has room for one request,
    When the lane message meets the request, which is left to reconciliation, and Redis fails as the sends are
    marked so (then answers again),
    Then both messages end, and the partition's offset moves past them (before: the retry copy, taken out of the
    queue to end with the request, was in neither the queue nor a request after the failure: its offset was never
    finished and the partition's committed offset stayed behind it until a restart)."""
    send, jobs, key = _orphaned_request()
    failures = [StoreUnavailable("Redis timed out (test)")]
    mark_reconcile = jobs.mark_reconcile

    def failing_once(tenant, send_ids, request_key):
        if failures:
            raise failures.pop()
        mark_reconcile(tenant, send_ids, request_key)

    jobs.mark_reconcile = failing_once
    lane_message = FakeMessage(0, 0, encode(send))
    retry_copy = FakeMessage(0, 1, encode(send), [("attempt", b"2")])
    worker, consumer, producer, provider = _worker([lane_message, retry_copy], jobs=jobs, window_s=0,
                                                   answer=ProviderResult("unavailable", 503))
    worker.redis_outage.base_s = worker.redis_outage.cap_s = 0.0
    worker.dispatcher.concurrency = 1
    _run(worker, steps=100)
    assert not failures and provider.sent == []
    assert consumer.stored.get((TOPIC, 0)) == 2 and worker.queues.buffered == 0


class IdempotentPerKey(FakeProvider):
    """Keeps idempotency keys per API key (per account); the first request is accepted and its answer lost."""

    def __init__(self):
        super().__init__(DELIVERED)
        self.accepted: dict[tuple[str, str], bytes] = {}
        self.answer_lost = True

    def post(self, path, body, api_key, idempotency_key):
        self.accepted.setdefault((api_key, idempotency_key), body)
        if self.answer_lost:
            self.answer_lost = False
            return ProviderResult("unknown", 502, error_name="bad_gateway")
        return DELIVERED

    def deliveries(self) -> Counter:
        return Counter(self.accepted.values())


def test_a_request_with_an_unknown_outcome_is_not_sent_again_under_another_key_than_it_went_under():
    """Given acme's email sent under the shared key and answered 502 (accepted, its answer lost: kept claimed),
    When the operator moves acme to an account of its own (a key of its own; workers restart with it) and the
    send's retry copy comes back,
    Then the request is not sent again under the new key: its sends go to reconciliation (dead-lettered
    unknown_outcome) and the provider delivered the email once (before: re-sent under its idempotency key to an
    account that never saw that key, and delivered a second time)."""
    sends, msgs = _messages(["acme"])
    provider = IdempotentPerKey()
    worker, consumer, producer, _ = _worker(msgs, jobs=RecordingJobs(), provider=provider)
    _run(worker)
    [retry_topic] = [t for t in producer.records if ".retry." in t]
    worker.routes.primary.credentials = ProviderCredentials({"*": "re_key", "acme": "re_acme_own"})
    value, headers = producer.records[retry_topic][0]
    consumer.pending.append(FakeMessage(0, 1, value, list(headers.items())))
    _run(worker)
    assert provider.deliveries() == {sends[0].send_id.encode(): 1}
    (_, dead), = producer.records[NAMES.dlq]
    assert dead["reason"] == b"unknown_outcome"


def test_a_send_a_provider_declined_still_has_its_last_attempt_for_a_real_failure():
    """Given a send the provider answered with a long 429 (the provider did not look at it),
    When its retry copy is sent and fails at what would be its last attempt counting the 429 as one,
    Then it is retried, not dead-lettered `retries_exhausted`: its copies carry the count of declined attempts
    (before, a send throttled k times had k fewer tries left for real failures)."""
    sends, msgs = _messages(["acme"])
    worker, _, producer, _ = _worker(msgs, answer=ProviderResult("throttled", 429, retry_after="120"))
    _run(worker)
    [(value, headers)] = [r for t, records in producer.records.items() if ".retry." in t for r in records]
    assert (headers["attempt"], headers["declined"]) == (b"2", b"1")
    last = load_policies()[sends[0].policy].max_attempts
    copy = FakeMessage(0, 1, value, list({**headers, "attempt": str(last).encode()}.items()))
    worker, _, producer, provider = _worker([copy], answer=ProviderResult("unavailable", 503))
    _run(worker)
    assert len(provider.sent) == 1 and NAMES.dlq not in producer.records
    [(_, again)] = [r for t, records in producer.records.items() if ".retry." in t for r in records]
    assert (again["attempt"], again["declined"]) == (str(last + 1).encode(), b"1")


def test_a_dead_letter_counts_a_last_attempt_the_provider_declined():
    """Given a retry copy of a send the provider declined once before (`declined: 1`, attempt 3),
    When the provider declines it again with a Retry-After past the send's max age,
    Then it is dead-lettered `too_old` saying 2 of its 3 attempts were declined (before: 1; the last one left out)."""
    sends, _ = _messages(["acme"])
    max_age_s = load_policies()[sends[0].policy].max_age_s
    copy = FakeMessage(0, 1, encode(sends[0]), [("attempt", b"3"), ("declined", b"1")])
    worker, _, producer, provider = _worker(
        [copy], answer=ProviderResult("throttled", 429, retry_after=str(max_age_s + 60)))
    _run(worker)
    assert len(provider.sent) == 1
    (_, letter), = producer.records[NAMES.dlq]
    assert (letter["reason"], letter["attempts"], letter["declined"]) == (b"too_old", b"3", b"2")


def test_a_recovered_request_carries_one_retry_chain_of_each_send_on():
    """Given a send whose request's sender died (its outcome unknown), and whose lane message (attempt 1) and retry
    copy (attempt 2) are both read again by the next worker, which has room for one request,
    When the lane message meets the request and re-sends it, the retry copy queued behind it settling with it, and
    the re-send fails,
    Then one retry copy carries the send on, for attempt 3 (before: one copy per message the request settled, for
    attempts 2 and 3: two retry chains of one send, each sent on its own schedule)."""
    send, jobs, key = _orphaned_request()
    lane_message = FakeMessage(0, 0, encode(send))
    retry_copy = FakeMessage(0, 1, encode(send), [("attempt", b"2")])
    worker, consumer, producer, provider = _worker([lane_message, retry_copy], jobs=jobs,
                                                   answer=ProviderResult("unavailable", 503))
    worker.dispatcher.concurrency = 1
    _run(worker)
    assert len(provider.sent) == 1 and consumer.stored[(TOPIC, 0)] == 2
    copies = [headers for t, records in producer.records.items() if ".retry." in t for _, headers in records]
    assert [h["attempt"] for h in copies] == [b"3"]


def test_a_re_sent_request_answered_skipped_is_final_too():
    """Given a delivery whose request's sender died (its outcome unknown), re-sent by the next worker and answered
    `skipped` (the endpoint was disabled meanwhile: the request stays claimed, its first copy's fate unknown),
    When the same message is read again after the endpoint came back (a rebalance),
    Then nothing is sent: the request remembers the attempt skipped, and the copy is stale (before: it took the
    request over and re-sent it, hours late)."""
    send, jobs, key = _orphaned_request()
    worker, consumer, producer, provider = _worker([FakeMessage(0, 0, encode(send))], jobs=jobs,
                                                   answer=ProviderResult("skipped", error_name="endpoint_disabled"))
    _run(worker)
    assert len(provider.sent) == 1 and jobs.records[key].attempts == {send.send_id: 2}
    provider.answer = DELIVERED
    consumer.pending.append(FakeMessage(0, 1, encode(send)))
    _run(worker)
    assert len(provider.sent) == 1 and consumer.stored[(TOPIC, 0)] == 2


def test_a_copy_behind_the_attempt_its_request_carries_on_is_stale_whenever_it_arrives():
    """Given a send whose retry copy for attempt 2 was claimed and sent by a worker that then died (its outcome
    unknown),
    When the next worker reads the send's lane message (attempt 1) first, then the attempt 2 copy, whose re-send
    fails, and later the attempt 2 copy once more (the retrier releasing it again),
    Then only the attempt 2 copy is sent, once, and one retry copy carries the send on, for attempt 3; the lane
    message and the copy read again are stale (before: each took the request over and was re-sent, and each
    failure made a retry copy of its own: a second and a third chain of attempts of one send)."""
    send, jobs, key = _orphaned_request(attempt=2)
    worker, consumer, producer, provider = _worker([FakeMessage(0, 0, encode(send))], jobs=jobs,
                                                   answer=ProviderResult("unavailable", 503))
    _run(worker)
    assert provider.sent == [] and consumer.stored[(TOPIC, 0)] == 1
    for offset in (1, 2):
        consumer.pending.append(FakeMessage(0, offset, encode(send), [("attempt", b"2")]))
        _run(worker)
    assert len(provider.sent) == 1 and consumer.stored[(TOPIC, 0)] == 3
    copies = [headers for t, records in producer.records.items() if ".retry." in t for _, headers in records]
    assert [h["attempt"] for h in copies] == [b"3"] and jobs.records[key].attempts == {send.send_id: 3}


@pytest.mark.parametrize("refusal", [
    ProviderResult("throttled", 429, retry_after="0", error_name="rate_limit_exceeded", first_copy_unknown=True),
    ProviderResult("throttled", 429, retry_after="120", error_name="rate_limit_exceeded", first_copy_unknown=True),
    ProviderResult("unavailable", error_name="connection_refused", first_copy_unknown=True),
], ids=["short 429", "long 429", "connection refused"])
def test_a_request_sent_twice_in_its_attempt_whose_second_copy_fails_keeps_its_sends_claimed(refusal):
    """Given a batch of three marketing emails whose request the provider read on a pooled connection and
    then closed unanswered, and whose second copy, sent at once on a new connection, was refused (a 429, a
    refused connection: the HTTP adapter marks such a result `first_copy_unknown`),
    When the sends come back (in the worker after a short 429, from a retry tier otherwise),
    Then they stay claimed under the first key: every request the provider sees carries that key, and each
    email is delivered once (released, they would be re-batched under new keys: delivered twice)."""
    sends, msgs = _messages(["acme"] * 3)
    provider, jobs = KeyedProvider([KeyedProvider.READ_THEN_REFUSED, refusal]), ReleaseNotingJobs()
    worker, consumer, producer, _ = _worker(msgs, jobs=jobs, lane="marketing", provider=provider)
    _run(worker)
    returned = 0
    while returned < sum(len(producer.records[t]) for t in producer.records if ".retry." in t):
        copies = [c for t in producer.records if ".retry." in t for c in producer.records[t]]
        value, headers = copies[returned]
        consumer.pending.append(FakeMessage(0, 3 + returned, value, list(headers.items())))
        returned += 1
        _run(worker)
    assert set(provider.keys) == {provider.keys[0]} and len(provider.keys) >= 2, provider.keys
    assert provider.deliveries() == {s.send_id.encode(): 1 for s in sends}
    assert provider.keys[0] not in jobs.released  # after a short 429 a release would re-batch the same three


class ReleaseNotingJobs(RecordingJobs):
    def __init__(self):
        super().__init__()
        self.released: list[str] = []

    def release(self, tenant, send_ids, key, owner, earlier=None):
        self.released.append(key)
        return super().release(tenant, send_ids, key, owner, earlier)


def test_a_batch_answered_500_keeps_its_sends_claimed_and_only_its_request_is_sent_again():
    """Given a batch of three marketing emails the provider accepted before it answered 500,
    When each retry copy comes back,
    Then the sends stayed claimed under the batch's key: every request the provider sees is the first one,
    byte for byte, under its key, and each email is delivered once (released, the copies would come back
    at their own jittered times and be re-batched under new keys: every email twice)."""
    sends, msgs = _messages(["acme"] * 3)
    provider, jobs = KeyedProvider([KeyedProvider.FAILED_AFTER]), RecordingJobs()
    worker, consumer, producer, _ = _worker(msgs, jobs=jobs, lane="marketing", provider=provider)
    _run(worker)
    retry_topic, = (t for t in producer.records if ".retry." in t)
    assert len(producer.records[retry_topic]) == 3 and len(provider.keys) == 1
    assert {jobs.state[s.send_id] for s in sends} == {f"inflight:{provider.keys[0]}"}
    for returned, (value, headers) in enumerate(list(producer.records[retry_topic])):
        consumer.pending.append(FakeMessage(0, 3 + returned, value, list(headers.items())))
        _run(worker)
    assert set(provider.keys) == {provider.keys[0]} and len(provider.keys) >= 2, provider.keys
    assert provider.deliveries() == {s.send_id.encode(): 1 for s in sends}


class TakenOverJobs(FakeJobs):
    """Another worker took every request over (its holder's lease lapsed): a release frees nothing."""

    def release(self, tenant, send_ids, key, owner, earlier=None):
        return False


@pytest.mark.parametrize("answer, events", [
    (ProviderResult("rejected", 413, error_name="request_too_large"),
     [("dead_lettered", "unknown_outcome", None)] * 3),
    (ProviderResult("unavailable", 503, error_name="http_503"), [("retrying", "provider_unavailable", True)] * 3),
], ids=["refused for its size", "unavailable"])
def test_a_batch_failed_while_another_worker_holds_its_claim_stays_whole_under_its_key(answer, events):
    """Given a batch of three marketing emails that fails after another worker took its request over (the release
    frees nothing: that worker's re-send may yet be accepted),
    When the worker settles it,
    Then a 413 does not split it into three single requests (each under a new key, beside the other worker's
    re-send of the whole batch: every email twice) and its dead letters say `unknown_outcome` (the provider may
    hold that worker's copy: a replay needs a check first), and the events of its retry copies say the batch is
    kept (before: split, and the events said nothing, so a recovery from lost Redis data left the sends free)."""
    sends, msgs = _messages(["acme"] * 3)
    worker, consumer, producer, provider = _worker(msgs, answer=answer, jobs=TakenOverJobs(), lane="marketing")
    _run(worker)
    assert len(provider.sent) == 1  # the batch, never its parts
    outcomes = [orjson.loads(v) for v, _ in producer.records[NAMES.outcomes]]
    assert [(e["status"], e["reason"], e.get("kept")) for e in outcomes] == events


def test_a_batch_answered_2xx_naming_fewer_messages_than_it_held_is_not_recorded_delivered():
    """Given a batch of three marketing emails answered 200 with one message id (two refused, as a permissive batch
    mode answers, without saying which),
    When the worker settles it,
    Then no email of it is recorded delivered (before: all three were, two of them never sent): the sends stay
    claimed under the batch's key, to be asked again under it, each with a retry copy."""
    sends, msgs = _messages(["acme"] * 3)
    jobs = RecordingJobs()
    worker, consumer, producer, provider = _worker(msgs, answer=ProviderResult("delivered", 200, ("m-only",)),
                                                   jobs=jobs, lane="marketing")
    _run(worker)
    statuses = [orjson.loads(v)["status"] for v, _ in producer.records.get(NAMES.outcomes, [])]
    assert "delivered" not in statuses and statuses, statuses
    [key] = {jobs.state[s.send_id] for s in sends}
    assert key.startswith("inflight:")
    retry_topic, = (t for t in producer.records if ".retry." in t)
    assert sorted(h["send_id"] for _, h in producer.records[retry_topic]) == sorted(s.send_id.encode() for s in sends)


def test_a_send_whose_first_answer_was_lost_and_whose_resends_all_fail_is_dead_lettered_unknown_outcome():
    """Given an email the provider accepted but whose answer was lost (502), and every re-send of its request
    refused (503) until its attempts are used up,
    When the last attempt fails,
    Then it is dead-lettered `unknown_outcome`, not `retries_exhausted` (the provider holds the first copy: a
    replay, which has a new send id, would deliver it a second time)."""
    _, msgs = _messages(["acme"])
    provider = KeyedProvider([KeyedProvider.LOST] + [ProviderResult("unavailable", 503)] * 50)
    worker, consumer, producer, _ = _worker(msgs, jobs=RecordingJobs(), lane="marketing", provider=provider)
    _run(worker)
    retry_topics = lambda: [t for t in producer.records if ".retry." in t]  # noqa: E731
    returned = 0
    while NAMES.dlq not in producer.records:
        copies = [c for t in retry_topics() for c in producer.records[t]]
        assert returned < len(copies), "neither retried nor dead-lettered"
        value, headers = copies[returned]
        consumer.pending.append(FakeMessage(0, 1 + returned, value, list(headers.items())))
        returned += 1
        _run(worker)
    [(_, headers)] = producer.records[NAMES.dlq]
    assert headers["reason"] == b"unknown_outcome" and returned >= 2
    assert set(provider.keys) == {provider.keys[0]}


@pytest.mark.parametrize("retry_after, spilled", [("600", True), ("31536000", False)], ids=["10 min", "a year"])
def test_a_receivers_long_retry_after_moves_its_queued_deliveries_off_the_worker(retry_after, spilled):
    """Given a receiver with its own limit (as a webhook endpoint) that answers 429 with a long Retry-After,
    When more messages for it arrive while it is held, behind them another tenant's,
    Then the held queue's messages leave the worker's memory: each to the retry tier due when the receiver
    asked (not an attempt), or dead-lettered `too_old` when that is past its max age; the partition's offset
    moves past all of them instead of waiting in memory for the whole Retry-After."""
    sends, msgs = _messages(["acme", "acme", "acme", "globex"])
    answers = [ProviderResult("throttled", 429, retry_after=retry_after, error_name="http_429"), DELIVERED]
    worker, consumer, producer, provider = _worker(msgs[:1])
    worker.routes.primary.spec = replace(worker.routes.primary.spec, shared_limit=False)
    provider.post = lambda *args: (provider.sent.append(args[1]), answers.pop(0) if answers else DELIVERED)[1]
    _run(worker)
    consumer.pending += msgs[1:]
    _run(worker)
    assert provider.sent == [sends[0].send_id.encode(), sends[3].send_id.encode()]  # acme's endpoint: left alone
    assert worker.queues.buffered == 0 and consumer.stored[(TOPIC, 0)] == 4
    parked = [h for t, records in producer.records.items() if ".retry." in t for _, h in records
              if h.get("retry_reason") == b"endpoint_retry_after"]
    too_old = [h for _, h in producer.records.get(NAMES.dlq, []) if h["reason"] == b"too_old"]
    if spilled:
        assert sorted(h["send_id"] for h in parked) == sorted(s.send_id.encode() for s in sends[1:3])
        assert {h["attempt"] for h in parked} == {b"1"}
        assert {h["tier"] for h in parked} == {b"15m"}  # the shortest tier that covers 10 min
    else:
        assert not parked and len(too_old) == 3  # the first by its own decision, then the two queued


def test_a_long_hold_settled_late_spills_its_queue_due_when_the_hold_ends_not_before():
    """Given a queue held 10 minutes by an answer settled a minute late (the settlement retried after a Redis
    outage keeps the answer's time),
    When the worker moves what the queue holds off to the retry tier,
    Then each copy is due when the hold ends (before: 10 minutes from the answer, a minute early: a copy due
    before its hold ends comes straight back, is spilled again, and goes round the tier until the hold ends)."""
    sends, msgs = _messages(["acme"])
    worker, consumer, producer, provider = _worker(msgs)
    now_ms = int(time.time() * 1000)
    worker.settler.hold_long("acme", 600, "endpoint_retry_after", now_ms=now_ms - 60_000)
    _run(worker)
    [(_, headers)] = [r for topic, records in producer.records.items() if ".retry." in topic for r in records]
    assert int(headers["due_at_ms"]) >= now_ms + 599_000 and provider.sent == []


def test_a_pacing_pause_between_waves_is_waited_out_not_spun_on():
    """Given a provider paced to one request at a time with a second's pause between waves, and five sends queued,
    When the first request has been answered,
    Then the worker waits for the pause's end (its idle wait is not 0; before: it spun, polling and scanning every
    queue, about 20,000 times a second until the pause ended)."""
    sends, msgs = _messages(["acme"] * 5)
    worker, consumer, producer, provider = _worker(msgs)
    route = worker.routes.primary
    route.pacing = Pacing(concurrency=1, pause_ms=1000)
    for _ in range(5):
        worker.step()
    assert len(provider.sent) == 1 and not worker.dispatcher.in_flight
    assert worker._idle_timeout() > 0.1


class JobsGoingDown(FakeJobs):
    """FakeJobs whose reads fail (Redis down) once `down` is set."""

    down = False

    def status_many(self, groups):
        if self.down:
            raise StoreUnavailable("Redis unavailable (test)")
        return super().status_many(groups)


@pytest.mark.parametrize("redis", ["up", "down", "data lost"])
def test_copies_moved_off_a_long_hold_past_their_max_age_end_by_their_state(redis):
    """Given a receiver held for a year by its Retry-After, and queued behind it copies of sends that were
    delivered, whose attempt 1 failed already (a stale copy), whose request has no known outcome, and one fresh
    (read twice),
    When the hold moves them off the worker (all due after their max age),
    Then each ends as it would before an attempt: the delivered copy is a duplicate and the stale one skipped
    (neither dead-lettered `too_old`, which a DLQ replay would send again), the one the provider may hold is
    dead-lettered `unknown_outcome`, and only the fresh one `too_old`, once. With Redis down, or its data lost
    (every send would read as never tried), no state can be trusted: nothing is dead-lettered blind, every copy
    goes to the retry tier (looked at again when it comes back)."""
    sends, msgs = _messages(["acme"] * 5)
    jobs = JobsGoingDown()
    worker, consumer, producer, provider = _worker(msgs[:1], jobs=jobs)
    worker.routes.primary.spec = replace(worker.routes.primary.spec, shared_limit=False)
    provider.answer = ProviderResult("throttled", 429, retry_after="31536000", error_name="http_429")
    _run(worker)
    jobs.state.update({sends[1].send_id: "delivered", sends[2].send_id: "tried:1",
                       sends[3].send_id: "inflight:other-request"})
    jobs.down = redis == "down"
    if redis == "data lost":
        worker.guard = SimpleNamespace(check=lambda: False, recheck=lambda: None)
    consumer.pending += [FakeMessage(0, i + 1, encode(s)) for i, s in enumerate(sends[1:] + [sends[4]])]
    _run(worker)
    assert provider.sent == [sends[0].send_id.encode()]
    assert worker.queues.buffered == 0 and consumer.stored[(TOPIC, 0)] == 6
    reasons = [(h["send_id"].decode(), h["reason"]) for _, h in producer.records[NAMES.dlq]]
    parked = sorted(h["send_id"].decode() for t, records in producer.records.items() if ".retry." in t
                    for _, h in records)
    if redis != "up":
        assert reasons == [(sends[0].send_id, b"too_old")]  # by its own decision, before Redis went
        assert parked == sorted([s.send_id for s in sends[1:]] + [sends[4].send_id])
    else:
        assert sorted(reasons) == sorted([(sends[0].send_id, b"too_old"), (sends[3].send_id, b"unknown_outcome"),
                                          (sends[4].send_id, b"too_old")])
        assert parked == []


def test_copies_moved_off_long_holds_while_redis_is_down_wait_out_its_back_off():
    """Given two receivers (acme's and globex's) each held for a year, with a copy past its max age queued behind
    each, and Redis down,
    When the holds move them off the worker,
    Then Redis is asked once, not once per queue: the failure starts the outage's back-off, during which no
    state is read (each read of an unreachable Redis can take seconds of the poll loop), and both copies go
    to the retry tier."""
    sends, msgs = _messages(["acme", "globex", "acme", "globex"])
    jobs = JobsGoingDown()
    reads = []
    status_many = jobs.status_many
    jobs.status_many = lambda groups: (reads.append(groups), status_many(groups))[1]
    worker, consumer, producer, provider = _worker(msgs[:2], jobs=jobs)
    worker.routes.primary.spec = replace(worker.routes.primary.spec, shared_limit=False)
    provider.answer = ProviderResult("throttled", 429, retry_after="31536000", error_name="http_429")
    _run(worker)
    jobs.down, reads[:] = True, []
    consumer.pending += [FakeMessage(0, 2, encode(sends[2])), FakeMessage(0, 3, encode(sends[3]))]
    worker.step()
    assert len(reads) == 1 and worker.redis_outage.active
    parked = sorted(h["send_id"].decode() for t, records in producer.records.items() if ".retry." in t
                    for _, h in records)
    assert parked == sorted(s.send_id for s in sends[2:])


def test_a_request_whose_sender_died_is_not_sent_again_to_a_provider_without_idempotency_keys():
    """Given a batch claimed by a worker that died before the provider's answer, at a provider that does not
    honour idempotency keys,
    When another worker reads the batch's messages again and finds the request's lease lapsed,
    Then it does not re-send the request (the provider may have delivered it: a re-send could deliver twice):
    every send is dead-lettered `unknown_outcome` and marked for reconciliation, and the offsets move on."""
    sends, msgs = _messages(["acme", "acme"])
    ids = tuple(sorted(s.send_id for s in sends))
    jobs = RecordingJobs()
    jobs.claim(list(ids), "batch-k", "dead-worker", "/emails/batch", b"the body", "acme", "resend")
    worker, consumer, producer, provider = _worker(msgs, jobs=jobs, window_s=0, lane="marketing")
    _run(worker)
    assert provider.sent == []
    assert sorted(h["reason"] for _, h in producer.records[NAMES.dlq]) == [b"unknown_outcome"] * 2
    assert {jobs.state[i] for i in ids} == {"reconcile"} and consumer.stored[(TOPIC, 0)] == 2


class SilentProvider(FakeProvider):
    """Receivers that take every request and never answer (a tenant's slow endpoints)."""

    def submit(self, path, body, api_key, idempotency_key, tenant):
        self.sent.append(body)
        return Future()


def test_one_tenants_slow_receivers_leave_room_for_another_tenants_deliveries():
    """Given a worker whose queues are receivers (as webhook endpoints: 10 requests in flight, 2 per receiver,
    5 per tenant), tenant A's 12 deliveries to 6 receivers that never answer, then tenant B's one delivery,
    When the worker dispatches,
    Then A's receivers hold 5 of the worker's slots, not all 10, and B's delivery is sent at once."""
    sends = [build_send(validate_request({**email_request(), "correlation_id": f"receiver-{i % 6}"}), "a")
             for i in range(12)] + [build_send(validate_request({**email_request(), "correlation_id": "b-1"}), "b")]
    msgs = [FakeMessage(0, i, encode(s)) for i, s in enumerate(sends)]
    worker, consumer, producer, provider = _worker(msgs[:-1], provider=SilentProvider(DELIVERED))
    worker.queues.queue_key = lambda send: f"{send.tenant_id}/{send.correlation_id}"
    worker.dispatcher.concurrency, worker.dispatcher.per_queue, worker.dispatcher.per_tenant = 10, 2, 5
    for _ in range(10):
        worker.step()
    consumer.pending.append(msgs[-1])  # B's delivery comes after A's receivers took what they could
    for _ in range(10):
        worker.step()
    by_tenant = Counter(job.tenant for job in worker.dispatcher.in_flight.values())
    assert by_tenant == {"a": 5, "b": 1}
    assert sends[-1].send_id.encode() in provider.sent


class HeldProvider(FakeProvider):
    """Receivers that answer only when the test says so (`answer_all(tenant)`)."""

    def __init__(self, answer):
        super().__init__(answer)
        self.waiting: list[tuple[bytes, Future]] = []

    def submit(self, path, body, api_key, idempotency_key, tenant):
        self.sent.append(body)
        done: Future = Future()
        self.waiting.append((body, done))
        return done

    def answer_all(self, send_ids: set[str]) -> None:
        for body, done in self.waiting:
            if not done.done() and body.decode() in send_ids:
                done.set_result(self.answer)


def test_a_third_tenant_gets_the_next_freed_slot_while_two_tenants_fill_the_worker():
    """Given a worker whose queues are receivers (10 requests in flight, 2 per receiver, 5 per tenant), tenants A
    and B each with 12 deliveries to 6 slow receivers (holding all 10 slots), then tenant C's one delivery,
    When A's 5 requests are answered (5 slots free) and the worker dispatches, A's queues coming first,
    Then C's delivery is sent and A takes no more than its even share (3 of 10 among three tenants) (before: A took
    all 5 freed slots back, up to its 5, and C waited for the next slot that happened to reach it first)."""
    def delivery(tenant: str, i: int):
        return build_send(validate_request({**email_request(), "correlation_id": f"{tenant}-receiver-{i % 6}"}), tenant)

    sends = [delivery(t, i) for t in ("a", "b") for i in range(12)] + [delivery("c", 0)]
    msgs = [FakeMessage(0, i, encode(s)) for i, s in enumerate(sends)]
    worker, consumer, producer, provider = _worker(msgs[:-1], provider=HeldProvider(DELIVERED))
    worker.queues.queue_key = lambda send: f"{send.tenant_id}/{send.correlation_id}"
    worker.dispatcher.concurrency, worker.dispatcher.per_queue, worker.dispatcher.per_tenant = 10, 2, 5
    worker.dispatcher.rng = SimpleNamespace(shuffle=lambda keys: keys.sort(), random=lambda: 0.5)  # a's queues first
    for _ in range(10):
        worker.step()
    assert Counter(job.tenant for job in worker.dispatcher.in_flight.values()) == {"a": 5, "b": 5}
    consumer.pending.append(msgs[-1])
    worker.step()
    provider.answer_all({s.send_id for s in sends if s.tenant_id == "a"})
    for _ in range(10):
        worker.step()
    by_tenant = Counter(job.tenant for job in worker.dispatcher.in_flight.values())
    assert sends[-1].send_id.encode() in provider.sent
    assert by_tenant["c"] == 1 and by_tenant["a"] <= 3 and by_tenant["b"] == 5


@pytest.mark.parametrize("second, parked", [("1", 0), (None, 3)], ids=["Retry-After 1 s", "no Retry-After"])
def test_a_receivers_short_retry_after_ends_its_earlier_long_one(second, parked):
    """Given a receiver with its own limit and two requests to it in flight, answered 429 with Retry-After
    10 min and then with Retry-After 1 s (its latest word) or with none (a 1 s default of ours),
    When the worker settles both,
    Then with the receiver's own 1 s, what waits for it stays in the worker for that second; with our default,
    the receiver's 10 min stand and what waits for it is parked until then."""
    sends, msgs = _messages(["acme"] * 4)
    answers = [ProviderResult("throttled", 429, retry_after=wait, error_name="http_429") for wait in ("600", second)]
    worker, consumer, producer, provider = _worker(msgs)
    worker.routes.primary.spec = replace(worker.routes.primary.spec, shared_limit=False)
    worker.dispatcher.per_queue = 2
    provider.post = lambda *args: (provider.sent.append(args[1]), answers.pop(0) if answers else DELIVERED)[1]
    for _ in range(3):
        worker.step()
    assert len(provider.sent) == 2
    assert len([h for t, records in producer.records.items() if ".retry." in t for _, h in records
                if h.get("retry_reason") == b"endpoint_retry_after"]) == parked
    assert worker.queues.buffered == 3 - parked  # the two never sent, and the one throttled in process


def test_a_resent_request_refused_for_a_fallback_reason_does_not_move_to_the_next_provider():
    """Given an SMS whose request's sender died (its outcome is unknown), at a channel with a second provider,
    When the worker re-sends that request and the first provider refuses it for a reason that would
    otherwise hand the send to the second provider (`unsupported_destination`),
    Then the send is not handed on (the first copy may have been delivered: the second provider could
    deliver it twice); it follows the retry policy, and its claim stays under the first key."""
    registry = load_registry()
    send = build_send(validate_request(sms_request()), "acme")
    topic = NAMES.lane("sms", "transactional")
    msg = FakeMessage(0, 0, encode(send))
    msg.topic = lambda: topic
    jobs = RecordingJobs()
    jobs.claim([send.send_id], f"send-{send.send_id}", "dead-worker", "/sms/messages", b"the body", "acme", "")
    first = FakeProvider(ProviderResult("rejected", 400, error_name="unsupported_destination"))
    second = FakeProvider(DELIVERED)
    routes = Routes([Route(registry.providers[name], adapter, ProviderCredentials({"*": "k"}))
                     for name, adapter in (("sms", first), ("sms-b", second))])
    cfg = WorkerConfig("sms", "transactional", "unused:9092", registry.primary("sms"), NAMES)
    consumer, producer = FakeConsumer([msg]), FakeProducer()
    worker = LaneWorker(cfg, consumer, producer, routes, FakeGate(), jobs, load_policies())
    worker.consumer.subscribe([topic], on_assign=worker._on_assign)
    _run(worker)
    assert first.sent == [b"the body"] and second.sent == []
    handed_on = [h for t, records in producer.records.items() for _, h in records if h.get("provider") == b"sms-b"]
    assert handed_on == []
    assert jobs.state[send.send_id] == f"inflight:send-{send.send_id}"


def test_a_resent_request_whose_receiver_is_gone_keeps_its_claim():
    """Given a send whose request's sender died (its outcome is unknown),
    When the re-send is skipped (its webhook endpoint was deleted meanwhile),
    Then the send is recorded skipped and its claim stays under the first key (never released: the
    first copy may have been delivered)."""
    sends, msgs = _messages(["acme"])
    jobs = RecordingJobs()
    key = f"send-{sends[0].send_id}"
    jobs.claim([sends[0].send_id], key, "dead-worker", "/emails", b"the body", "acme", "")
    worker, consumer, producer, provider = _worker(msgs, jobs=jobs,
                                                   answer=ProviderResult("skipped", error_name="endpoint_deleted"))
    _run(worker)
    assert provider.sent == [b"the body"] and consumer.stored[(TOPIC, 0)] == 1
    assert jobs.state[sends[0].send_id] == f"inflight:{key}"


@pytest.mark.parametrize("reason", ["endpoint_deleted", "endpoint_disabled", "endpoint_degraded"])
def test_a_skipped_delivery_gives_its_tokens_back(reason):
    """Given a tenant's deliveries whose endpoint was deleted, disabled or degraded while they waited,
    When each is skipped, never sent,
    Then the tenant's bucket and the provider's get every token back: the tenant's healthy endpoints are not slowed,
    nor every tenant's webhooks by the shared bucket (before, each skip spent a message and a request)."""
    sends, msgs = _messages(["acme", "acme", "acme"])
    gate = FakeGate()
    worker, consumer, producer, provider = _worker(msgs, gate=gate, answer=ProviderResult("skipped", error_name=reason))
    _run(worker)
    assert len(provider.sent) == 3 and consumer.stored[(TOPIC, 0)] == 3
    assert [o for o in map(orjson.loads, (v for v, _ in producer.records[NAMES.outcomes]))
            if o["status"] == "skipped"] and gate.spent and not any(gate.spent.values())


class AckHoldingProducer(FakeProducer):
    """Acknowledges nothing until `release()`."""

    def __init__(self):
        super().__init__()
        self.holding = True

    def poll(self, timeout=0):
        return 0 if self.holding else super().poll(timeout)

    def release(self):
        self.holding = False


def test_a_copy_for_an_attempt_already_made_is_stale_and_a_send_never_runs_two_retry_chains():
    """Given an email whose attempt 1 the provider answered 503 (its retry copy, for attempt 2, written),
    When its lane message is read again (a worker killed before its offset was committed, a rebalance), and
    then its retry copy comes back,
    Then the re-read copy is skipped as stale (counted) and attempt 2 is made once, from the retry copy: the
    provider sees two attempts and one retry copy exists (before, the re-read copy was sent again as attempt
    1 and wrote a second retry copy: two chains, each with its own attempts and its own dead letter)."""
    from streams import metrics

    sends, msgs = _messages(["acme"])
    provider = FakeProvider(ProviderResult("unavailable", 503))
    worker, consumer, producer, _ = _worker(msgs, provider=provider)
    stale_before = metrics.STALE_COPIES.labels("email", "transactional")._value.get()
    _run(worker)
    [retry_topic] = [t for t in producer.records if ".retry." in t]
    [(copy, headers)] = producer.records[retry_topic]
    assert headers["attempt"] == b"2" and len(provider.sent) == 1
    consumer.pending.append(FakeMessage(0, 0, encode(sends[0])))  # the lane message, read again
    _run(worker)
    assert len(provider.sent) == 1 and len(producer.records[retry_topic]) == 1
    assert metrics.STALE_COPIES.labels("email", "transactional")._value.get() - stale_before == 1
    provider.answer = DELIVERED
    consumer.pending.append(FakeMessage(0, 1, copy, list(headers.items())))
    _run(worker)
    assert len(provider.sent) == 2 and len(producer.records[retry_topic]) == 1
    assert orjson.loads(producer.records[NAMES.outcomes][-1][0])["status"] == "delivered"


def test_a_message_read_again_before_its_failed_attempts_copy_was_acknowledged_is_sent_again_not_lost():
    """Given worker A whose attempt 1 of an email failed (503) and whose retry copy the broker never
    acknowledged (A died, its copy lost with it, its offset not stored),
    When worker B reads the message again (sharing processed_jobs with A),
    Then B sends it again as attempt 1: nothing marked it tried, since the copy that would carry it on never
    became durable (a mark written at the failure itself made B skip it as stale: the send was lost)."""
    sends, msgs = _messages(["acme"])
    jobs = FakeJobs()
    dead_a = AckHoldingProducer()
    a, _, _, provider_a = _worker(msgs, answer=ProviderResult("unavailable", 503), jobs=jobs, producer=dead_a)
    for _ in range(20):  # not `_run`: its drain would wait for the acknowledgement that never comes
        a.step()
    assert len(provider_a.sent) == 1 and jobs.state.get(sends[0].send_id) is None
    b, consumer_b, _, provider_b = _worker([FakeMessage(0, 0, encode(sends[0]))], jobs=jobs,
                                           answer=ProviderResult("unavailable", 503))
    _run(b)
    assert len(provider_b.sent) == 1 and consumer_b.stored[(TOPIC, 0)] == 1
    assert jobs.state[sends[0].send_id] == "tried:1"


def test_a_later_attempts_failure_keeps_the_earlier_mark_so_a_message_read_again_stays_stale():
    """Given an email marked tried:1 (its retry copy for attempt 2 durable), and worker A whose attempt 2 then
    fails (503) and whose next retry copy the broker has not acknowledged yet (A dies there),
    When worker B reads the lane message (attempt 1) again,
    Then B skips it as stale (before, A's release deleted the mark with its claim: B sent it again as attempt 1,
    a second chain)."""
    sends, _ = _messages(["acme"])
    jobs = FakeJobs()
    jobs.state[sends[0].send_id] = "tried:1"
    second = FakeMessage(0, 1, encode(sends[0]), [("attempt", b"2")])
    a, _, _, provider_a = _worker([second], answer=ProviderResult("unavailable", 503), jobs=jobs,
                                  producer=AckHoldingProducer())
    for _ in range(20):
        a.step()
    assert len(provider_a.sent) == 1 and jobs.state[sends[0].send_id] == "tried:1"
    b, consumer_b, _, provider_b = _worker([FakeMessage(0, 0, encode(sends[0]))], jobs=jobs)
    _run(b)
    assert provider_b.sent == [] and consumer_b.stored[(TOPIC, 0)] == 1


@pytest.mark.parametrize("attempt", [1, 3])
def test_a_skipped_delivery_read_again_is_never_sent_late(attempt):
    """Given a delivery (attempt 1, or a retry copy for attempt 3) skipped because its endpoint was disabled,
    When its message is read again after the endpoint came back (the retrier releasing the copy again after a
    restart, a rebalance before the offset was committed),
    Then the copy is stale and nothing is sent (before: the skip freed the send, and the copy went out hours late
    under its old id, after the tenant may have replayed it under a new one)."""
    sends, _ = _messages(["acme"])
    jobs = FakeJobs()
    if attempt > 1:
        jobs.state[sends[0].send_id] = f"tried:{attempt - 1}"
    headers = [("attempt", str(attempt).encode())] if attempt > 1 else []
    copy = FakeMessage(0, 0, encode(sends[0]), headers)
    a, consumer_a, producer_a, _ = _worker([copy], answer=ProviderResult("skipped", error_name="endpoint_disabled"),
                                          jobs=jobs)
    _run(a)
    assert consumer_a.stored[(TOPIC, 0)] == 1 and jobs.state[sends[0].send_id] == f"tried:{attempt}"
    b, consumer_b, _, provider_b = _worker([copy], jobs=jobs)
    _run(b)
    assert provider_b.sent == [] and consumer_b.stored[(TOPIC, 0)] == 1


def test_of_a_stale_copy_and_the_live_retry_copy_in_one_batch_the_live_one_is_sent():
    """Given a marketing email whose attempt 1 failed and whose retry copy (attempt 2) is durable (tried:1),
    When its lane message is read again and lands in the same batch as the retry copy,
    Then the retry copy is sent (attempt 2) and the stale copy skipped (before, the first copy of the send in
    the batch was kept, the stale one, then skipped as stale: neither was sent)."""
    sends, _ = _messages(["acme"])
    jobs = FakeJobs()
    jobs.state[sends[0].send_id] = "tried:1"
    msgs = [FakeMessage(0, 0, encode(sends[0])), FakeMessage(0, 1, encode(sends[0]), [("attempt", b"2")])]
    worker, consumer, producer, provider = _worker(msgs, jobs=jobs, lane="marketing")
    _run(worker)
    assert provider.sent == [sends[0].send_id.encode()]
    assert consumer.stored[(TOPIC, 0)] == 2 and jobs.state[sends[0].send_id] == "delivered"
    [delivered] = events_of(orjson.loads(producer.records[NAMES.outcomes][-1][0]))
    assert (delivered["status"], delivered["attempts"]) == ("delivered", 2)


@pytest.mark.parametrize("state", ["tried:1", None])
def test_an_expired_copy_of_a_send_whose_attempts_failed_definitely_is_too_old_not_unknown(state):
    """Given a send older than its policy allows whose earlier attempts failed definitely (or never made),
    When a copy for its next attempt is met,
    Then it is dead-lettered `too_old` (`unknown_outcome` is for sends the provider may hold)."""
    day_ago = int(time.time() * 1000) - 86_400_000
    send = build_send(validate_request(email_request()), "acme", now_ms=day_ago)
    jobs = FakeJobs()
    if state:
        jobs.state[send.send_id] = state
    worker, consumer, producer, provider = _worker([FakeMessage(0, 0, encode(send), [("attempt", b"2")])], jobs=jobs)
    _run(worker)
    [(_, headers)] = producer.records[NAMES.dlq]
    assert headers["reason"] == b"too_old" and provider.sent == []


class TopicHoldingProducer(FakeProducer):
    """Acknowledges the records of every topic but `held` at once; those of `held` after `release()`."""

    def __init__(self, held: str):
        super().__init__()
        self.held, self.waiting = held, []

    def produce(self, topic, value=None, key=None, headers=None, on_delivery=None):
        if topic == self.held and on_delivery is not None:
            self.records[topic].append((value, dict(headers or [])))
            self.waiting.append((on_delivery, FakeMessage(0, len(self.records[topic]) - 1, value)))
            return
        super().produce(topic, value, key, headers, on_delivery)

    def release(self):
        self._acks.extend(self.waiting)
        self.waiting = []


def test_a_failed_attempt_is_finished_only_once_its_history_and_its_retry_copy_are_both_acknowledged():
    """Given an email the provider answers 503, and a broker that acknowledges its retry copy but not yet the
    `retrying` outcome that records the attempt,
    When the worker settles it,
    Then its offset is not stored (before, it was, on the copy's acknowledgement alone: a crash then lost the
    attempt from the send's history); once the outcome is acknowledged too, it is."""
    _, msgs = _messages(["acme"])
    producer = TopicHoldingProducer(NAMES.outcomes)
    worker, consumer, _, _ = _worker(msgs, answer=ProviderResult("unavailable", 503), producer=producer)
    for _ in range(20):  # not `_run`: its drain would wait for the held acknowledgement
        worker.step()
    assert [t for t in producer.records if ".retry." in t] and producer.waiting
    assert consumer.stored.get((TOPIC, 0), 0) == 0
    producer.release()
    _run(worker, steps=5)
    assert consumer.stored[(TOPIC, 0)] == 1


def test_a_batched_request_writes_its_outcomes_in_one_record_and_finishes_offsets_on_its_ack():
    """Given three marketing emails of one tenant, sent in one batch request and delivered,
    When the worker settles the request,
    Then notif.outcomes gets one record keyed by the request, holding the three `delivered` events (each
    naming its send and where its message was read), and no offset is stored before the broker
    acknowledged that record; after the acknowledgement, all three are."""
    spec = load_registry().primary("email")
    cfg = WorkerConfig("email", "marketing", "unused:9092", spec, NAMES)
    sends = [build_send(validate_request(email_request("marketing")), "acme") for _ in range(3)]
    consumer, producer = FakeConsumer([FakeMessage(0, i, encode(s)) for i, s in enumerate(sends)]), AckHoldingProducer()
    provider = FakeProvider(ProviderResult("delivered", 200, ("m1", "m2", "m3")))
    routes = Routes([Route(spec, provider, ProviderCredentials({"*": "re_key"}))])
    worker = LaneWorker(cfg, consumer, producer, routes, FakeGate(), FakeJobs(), load_policies())
    worker.consumer.subscribe([TOPIC], on_assign=worker._on_assign)
    for _ in range(20):
        worker.step()

    assert len(provider.sent) == 1  # one batch request
    [(value, _)] = producer.records[NAMES.outcomes]
    events = events_of(orjson.loads(value))
    assert sorted(e["send_id"] for e in events) == sorted(s.send_id for s in sends)
    assert {e["status"] for e in events} == {"delivered"} and {e["provider_message_id"] for e in events} == {
        "m1", "m2", "m3"}
    assert sorted(e["origin"]["offset"] for e in events) == [0, 1, 2]
    assert consumer.stored.get((TOPIC, 0), 0) == 0  # not acknowledged yet: nothing finished

    producer.release()
    _run(worker, steps=5)
    assert consumer.stored[(TOPIC, 0)] == 3
    assert worker.settler.pending == 0 and len(producer.records[NAMES.outcomes]) == 1


class IdsInOrderProvider(FakeProvider):
    """A batch endpoint answering one id per message, in the order of the request's messages, which the adapter
    writes in send-id order (as every adapter does)."""

    def build(self, messages, batch):
        return super().build(sorted(messages, key=lambda m: m.send_id), batch)

    def post(self, path, body, api_key, idempotency_key):
        self.sent.append(body)
        return ProviderResult("delivered", 200, tuple(f"msg-{s}" for s in body.decode().split("|")))


def test_each_send_of_a_batch_gets_its_own_provider_message_id():
    """Given a marketing batch whose messages were read in an order other than their send ids' (a later send first),
    When the provider answers one id per message, in the request's order,
    Then each send's outcome names the id the provider gave it: the ids are paired with the send ids in the order
    the adapter wrote them, not the order the messages were read."""
    sends = [build_send(validate_request({**email_request(), "category": "marketing"}), "blast") for _ in range(3)]
    read_order = sorted(sends, key=lambda s: s.send_id, reverse=True)  # never the send-id order
    worker, consumer, producer, provider = _worker([FakeMessage(0, i, encode(s)) for i, s in enumerate(read_order)],
                                                   lane="marketing", provider=IdsInOrderProvider(DELIVERED))
    _run(worker)
    assert len(provider.sent) == 1 and [s.send_id for s in read_order] != sorted(s.send_id for s in sends)
    events = [e for value, _ in producer.records[NAMES.outcomes] for e in events_of(orjson.loads(value))]
    assert {e["send_id"]: e["provider_message_id"] for e in events} == {s.send_id: f"msg-{s.send_id}" for s in sends}


def test_a_provider_id_is_never_given_to_another_send():
    """An answer with another count of ids than the request's sends names no send's id rather than a wrong one
    (before: the first ids went to the first sends, whatever the answer left out); a request re-sent from its
    stored body (written in send-id order too) names each."""
    sends = [build_send(validate_request(email_request()), "acme") for _ in range(3)]
    members = [Pending(TOPIC, 0, i, b"", {}, s, 1) for i, s in enumerate(sends)]
    ids = tuple(s.send_id for s in sends)

    def job(members, resent=False):
        return Job("k", "/emails/batch", b"", "acme", tuple(sorted(p.send.send_id for p in members)), members,
                   resent=resent)

    assert provider_ids(job(members), ProviderResult("delivered", 200, ("a", "b"))) == {}
    assert provider_ids(job(members), ProviderResult("delivered", 200, ("a", "b", "c", "d"))) == {}
    in_order = dict(zip(sorted(ids), "abc", strict=True))
    assert provider_ids(job(members, resent=True), ProviderResult("delivered", 200, ("a", "b", "c"))) == in_order
    assert provider_ids(job(members[:1], resent=True), ProviderResult("delivered", 200, ("a",))) == {ids[0]: "a"}


def test_outcome_records_hold_one_event_or_several():
    single = {"send_id": "s1", "status": "delivered"}
    assert events_of(single) == [single]
    assert events_of({"events": [single, {"send_id": "s2"}, "not an event"]}) == [single, {"send_id": "s2"}]
    assert events_of([1, 2]) == [] and events_of("x") == []


class CountingJobs(FakeJobs):
    """processed_jobs that counts the sends each dispatch round reads."""

    def __init__(self):
        super().__init__()
        self.reads: list[int] = []

    def status_many(self, groups):
        self.reads.append(sum(len(ids) for _, ids in groups))
        return super().status_many(groups)


class BurstGate(FakeGate):
    def __init__(self, burst: int):
        super().__init__()
        self.burst, self.asked = burst, []

    def tenant_limit(self, provider, tenant): return Limit(1_000_000, self.burst)

    def acquire_many(self, requests):
        self.asked.append(sum(r[2] for r in requests))
        return super().acquire_many(requests)


@pytest.mark.parametrize("burst, per_round", [(100, 100), (300, 300), (1000, 450)])
def test_a_round_draws_no_more_of_a_tenant_than_its_bucket_can_admit(burst, per_round):
    """A lone tenant's marketing blast (batches of 100) fills the worker's free slots in one round only as
    far as its bucket's burst reaches: the processed_jobs read and the gate see just the requests that
    can be admitted together, and nothing drawn goes back. Every send still goes out once."""
    sends = [build_send(validate_request({**email_request(), "category": "marketing"}), "blast")
             for _ in range(450)]
    jobs, gate = CountingJobs(), BurstGate(burst)
    worker, consumer, producer, provider = _worker([FakeMessage(0, i, encode(s)) for i, s in enumerate(sends)],
                                                   gate=gate, jobs=jobs, lane="marketing")
    worker.step()
    assert jobs.reads[0] == per_round and gate.asked[0] == per_round
    _run(worker)
    assert sum(body.count(b"|") + 1 for body in provider.sent) == 450
    assert sum(jobs.reads) == 450 and consumer.stored[(TOPIC, 0)] == 450


class PickyProvider(FakeProvider):
    """An adapter that cannot build a request from a payload whose subject is `poison`."""

    def build(self, messages, batch):
        if any(m.payload.get("subject") == "poison" for m in messages):
            raise KeyError("endpoint_id")
        return super().build(messages, batch)


def test_a_payload_the_adapter_cannot_build_is_dead_lettered_and_its_batch_goes_without_it():
    """A marketing batch of six, one of whose payloads the provider adapter cannot read (written to the lane
    directly, past ingest): that send is dead-lettered as malformed, with the adapter's error, the five others
    go out together once, and every offset is finished; the worker does not raise."""
    def marketing(**payload):
        return build_send(validate_request({**email_request(**payload), "category": "marketing"}), "blast")

    sends = [marketing() for _ in range(2)] + [marketing(subject="poison")] + [marketing() for _ in range(3)]
    provider = PickyProvider(DELIVERED)
    worker, consumer, producer, _ = _worker([FakeMessage(0, i, encode(s)) for i, s in enumerate(sends)],
                                            lane="marketing", provider=provider)
    _run(worker)
    good = [s.send_id for i, s in enumerate(sends) if i != 2]
    assert len(provider.sent) == 1 and sorted(provider.sent[0].decode().split("|")) == sorted(good)
    (value, headers), = producer.records[NAMES.dlq]
    assert value == encode(sends[2]) and headers["reason"] == b"malformed"
    assert headers["detail"] == b"the resend request cannot be built from this payload: missing field 'endpoint_id'"
    assert consumer.stored[(TOPIC, 0)] == 6


@pytest.mark.parametrize("headers, detail", [([("attempt", None)], "'attempt' is not an integer: None"),
                                             ([], "category: Input should be")])
def test_an_event_of_an_unforeseen_shape_is_dead_lettered_not_a_crash(headers, detail):
    """A category that is a JSON array, or an `attempt` header without a value: dead-lettered as malformed
    with a detail saying why; the offset moves on."""
    sends, msgs = _messages(["acme"])
    value = msgs[0].value() if headers else b'{"v": 1, "category": [1], "lane": "transactional"}'
    worker, consumer, producer, provider = _worker([FakeMessage(0, 0, value, headers)])
    _run(worker)
    (_, dlq_headers), = producer.records[NAMES.dlq]
    assert dlq_headers["reason"] == b"malformed" and detail in dlq_headers["detail"].decode()
    assert provider.sent == [] and consumer.stored[(TOPIC, 0)] == 1


class LimitsDownGate(FakeGate):
    """A gate whose tenant limits cannot be read (Redis down) for the first `failures` reads."""

    def __init__(self, failures: int):
        super().__init__()
        self.failures = failures

    def tenant_limit(self, provider, tenant):
        if self.failures > 0:
            self.failures -= 1
            raise StoreUnavailable("Redis unavailable (test)")
        return super().tenant_limit(provider, tenant)


def test_redis_failing_while_a_round_is_drawn_holds_the_messages_and_resumes():
    """The tenant's limits are read (from Redis, once they are 10 s old) while a round is drawn: when that
    read fails, what was drawn goes back to its queue and the worker holds with backoff, instead of the
    error leaving the worker's loop; once Redis answers, every send goes out once."""
    sends, msgs = _messages(["acme", "globex", "acme"])
    worker, consumer, producer, provider = _worker(msgs, gate=LimitsDownGate(failures=2))
    worker.redis_outage.base_s = worker.redis_outage.cap_s = 0.0
    worker.step()
    assert worker.redis_outage.active and worker.queues.buffered + len(worker.dispatcher.in_flight) >= 1
    _run(worker)
    assert sorted(provider.sent) == sorted(s.send_id.encode() for s in sends)
    assert consumer.stored[(TOPIC, 0)] == 3


class SingleOnlyProvider(FakeProvider):
    """An adapter configured for batches it cannot make (the way the SMS adapters refuse one)."""

    refuse = True

    def build(self, messages, batch):
        if self.refuse and len(messages) > 1:
            raise ValueError("the SMS gateway takes one message per request")
        return super().build(messages, batch)


def test_an_adapter_refusing_the_requests_shape_holds_the_queue_and_dead_letters_nothing(caplog):
    """A provider whose adapter refuses batches but is configured to batch (a configuration error, not bad
    payloads): the sends are held and the error is logged; none is dead-lettered, none is lost, and they go
    out once the configuration is fixed."""
    sends = [build_send(validate_request({**email_request(), "category": "marketing"}), "blast") for _ in range(4)]
    provider = SingleOnlyProvider(DELIVERED)
    worker, consumer, producer, _ = _worker([FakeMessage(0, i, encode(s)) for i, s in enumerate(sends)],
                                            lane="marketing", provider=provider)
    with caplog.at_level("ERROR"):
        for _ in range(3):
            worker.step()
    assert provider.sent == [] and not producer.records.get(NAMES.dlq)
    assert worker.queues.buffered == 4 and "holding the queue" in caplog.text
    provider.refuse = False
    for q in worker.queues.queues.values():
        q.ready_at = 0.0  # the hold (5 s) is over
    _run(worker)
    assert sum(body.count(b"|") + 1 for body in provider.sent) == 4 and consumer.stored[(TOPIC, 0)] == 4


class RacingJobs(FakeJobs):
    """processed_jobs where another worker claims the first two sends between this worker's status read and its
    claim."""

    def __init__(self, sends):
        super().__init__()
        self.racers = [s.send_id for s in sends[:2]]

    def claim(self, send_ids, key, owner, path, body, tenant, provider="", attempts=None, account=""):
        for s in self.racers:
            self.state.setdefault(s, "inflight:another-workers-request")
        return super().claim(send_ids, key, owner, path, body, tenant, provider, attempts, account)


@pytest.mark.parametrize("case, sent, charged", [
    ("the adapter refuses the request's shape", 0, (0, 0)),
    ("the adapter cannot read one payload", 5, (5, 1)),
    ("a racing worker claimed two sends", 2, (2, 1)),
])
def test_a_tenant_is_charged_only_for_the_sends_a_round_sent(case, sent, charged):
    """Given a marketing batch the gate admitted whole,
    When its request goes out with fewer sends (a payload dead-lettered, sends another worker claimed meanwhile)
    or not at all (the adapter refusing its shape, held),
    Then the tokens of what did not go out are given back: the tenant's bucket holds spent only the messages sent,
    and the global bucket only the requests sent, so its next requests are not delayed by tokens nobody used."""
    def marketing(**payload):
        return build_send(validate_request({**email_request(**payload), "category": "marketing"}), "blast")

    jobs = FakeJobs()
    if case == "the adapter refuses the request's shape":
        sends, provider = [marketing() for _ in range(4)], SingleOnlyProvider(DELIVERED)
    elif case == "the adapter cannot read one payload":
        sends, provider = [marketing() for _ in range(5)] + [marketing(subject="poison")], PickyProvider(DELIVERED)
    else:
        sends, provider = [marketing() for _ in range(4)], FakeProvider(DELIVERED)
        jobs = RacingJobs(sends)
    gate = FakeGate()
    worker, consumer, producer, _ = _worker([FakeMessage(0, i, encode(s)) for i, s in enumerate(sends)], gate=gate,
                                            jobs=jobs, lane="marketing", provider=provider)
    for _ in range(5):
        worker.step()
    assert sum(len(body.split(b"|")) for body in provider.sent) == sent
    assert (gate.spent[("resend", "blast", "messages")], gate.spent[("resend", "blast", "requests")]) == charged


class RefundRefusingGate(FakeGate):
    def refund_many(self, admitted):
        raise GateUnavailable("bucket gate unavailable (Redis down, test); nothing given back")


def test_tokens_redis_refuses_to_take_back_stay_spent_and_the_round_goes_on(caplog):
    """Redis failing as the round gives back the tokens of a dead-lettered payload: the tokens stay spent (they
    refill with time), a warning says so, and the five other sends still go out once, every offset finished."""
    sends = [build_send(validate_request({**email_request(subject=subject), "category": "marketing"}), "blast")
             for subject in ["hi"] * 5 + ["poison"]]
    gate = RefundRefusingGate()
    worker, consumer, producer, provider = _worker([FakeMessage(0, i, encode(s)) for i, s in enumerate(sends)],
                                                   gate=gate, lane="marketing", provider=PickyProvider(DELIVERED))
    with caplog.at_level("WARNING"):
        _run(worker)
    assert sum(len(body.split(b"|")) for body in provider.sent) == 5 and len(producer.records[NAMES.dlq]) == 1
    assert gate.spent[("resend", "blast", "messages")] == 6 and consumer.stored[(TOPIC, 0)] == 6
    assert "could not give back the gate's tokens of 1 admission(s)" in caplog.text


class ExpiredRecordJobs(FakeJobs):
    """processed_jobs where a request's record expired (past the provider's idempotency window) while its
    sends stayed claimed."""

    def take_over(self, tenant, key, owner, send_ids=()): return RECORD_GONE


def test_a_send_whose_request_record_expired_is_left_to_reconciliation_not_sent_again():
    """Given a send still claimed under a request whose record expired (its outcome has been unknown for longer
    than the provider keeps idempotency keys),
    When a worker meets the send again,
    Then nothing is sent (a re-send or a fresh request could deliver it twice): the send is marked `reconcile`
    and dead-lettered `unknown_outcome`, and its offset is done."""
    jobs = ExpiredRecordJobs()
    send = _met_in_state_and_dead_lettered_unknown(jobs, "inflight:batch-expired")
    assert jobs.state[send.send_id] == "reconcile"


def test_a_send_left_to_reconciliation_and_met_again_is_dead_lettered_not_skipped_unrecorded():
    """Given a send already marked `reconcile` (its outcome is unknown at a provider that does not honour
    idempotency keys) whose own dead letter was never written (a batch member met after the others were
    dead-lettered, or a crash between the mark and the dead letter),
    When a worker meets the send,
    Then it is dead-lettered `unknown_outcome` (so an operator sees it), nothing is sent, and its offset is done."""
    _met_in_state_and_dead_lettered_unknown(FakeJobs(), "reconcile")


def _met_in_state_and_dead_lettered_unknown(jobs, state: str):
    """One send whose processed_jobs state is `state`, met by a worker: it is not sent, it is dead-lettered
    `unknown_outcome`, and its offset is done. Returns the send."""
    sends, msgs = _messages(["acme"])
    jobs.state[sends[0].send_id] = state
    worker, consumer, producer, provider = _worker(msgs, jobs=jobs)
    _run(worker)
    assert provider.sent == []
    (_, headers), = producer.records[NAMES.dlq]
    assert headers["reason"] == b"unknown_outcome"
    assert consumer.stored[(TOPIC, 0)] == 1
    return sends[0]


class BatchedConsumer(FakeConsumer):
    """Hands out the given batches, never two in one `consume_ready`, and knows its position (the offset
    after the last message it handed out of each partition), as a real consumer does."""

    def __init__(self, batches):
        super().__init__([])
        self.batches, self.positions = list(batches), {}

    def consume(self, num_messages=1, timeout=0):
        if self.on_assign:
            super().consume(0, 0)
        if not self.batches:
            return []
        batch = self.batches[0]
        out = batch[:num_messages]
        del batch[:num_messages]
        if not batch:
            self.batches.pop(0)
        for m in out:
            self.positions[m.partition()] = m.offset() + 1
        return out

    def position(self, partitions):
        from confluent_kafka import TopicPartition
        return [TopicPartition(tp.topic, tp.partition, self.positions.get(tp.partition, -1001)) for tp in partitions]


class DeadLettersFailing(FakeProducer):
    """A producer whose every DLQ write fails before it leaves the process (a fenced or fatal producer)."""

    def produce(self, topic, value=None, key=None, headers=None, on_delivery=None):
        from confluent_kafka import KafkaError, KafkaException
        if topic == NAMES.dlq:
            raise KafkaException(KafkaError(KafkaError._FATAL, "producer fenced (test)"))
        super().produce(topic, value, key, headers, on_delivery)


def test_a_worker_stopped_by_a_failure_mid_batch_stores_no_offset_past_what_it_took_in():
    """Given a worker that has finished partition 1's first send, then gets one batch holding a poison event on
    partition 0 followed by a valid send on partition 1, and whose dead letter write fails with an error
    it cannot handle,
    When taking the poison in fails and the worker stops (as `run` does),
    Then the offset stored for partition 1 stays at 1: the send behind the poison is read again by the next
    worker (before, the consumer's position, 2, was stored and that send was never delivered)."""
    sends, _ = _messages(["acme", "acme"])
    first, behind = (FakeMessage(1, i, encode(s)) for i, s in enumerate(sends))
    consumer = BatchedConsumer([[first]])
    spec = load_registry().primary("email")
    routes = Routes([Route(spec, FakeProvider(DELIVERED), ProviderCredentials({"*": "re_key"}))])
    worker = LaneWorker(WorkerConfig("email", "transactional", "unused:9092", spec, NAMES), consumer,
                        DeadLettersFailing(), routes, FakeGate(), FakeJobs(), load_policies())
    worker.consumer.subscribe([TOPIC], on_assign=worker._on_assign)
    for _ in range(3):
        worker.step()
    worker._drain()
    worker.step()
    assert consumer.stored[(TOPIC, 1)] == 1  # the first send is done
    consumer.batches.append([FakeMessage(0, 0, b"not json"), behind])
    with pytest.raises(Exception, match="fenced"):
        worker.step()
    worker.shutdown()
    assert consumer.stored[(TOPIC, 1)] == 1


def test_an_old_copy_of_a_delivered_send_is_a_duplicate_not_a_dead_letter():
    """Given a send delivered a day ago, read again from its lane (a retrier restarted behind a frozen
    offset re-publishes copies released long ago), and a send as old that was never delivered,
    When the worker meets them,
    Then the delivered one is skipped as a duplicate (before: dead-lettered `too_old`, which an operator
    replaying the DLQ would have sent a second time) and the other is dead-lettered `too_old`."""
    day_ago = int(time.time() * 1000) - 86_400_000
    sends = [build_send(validate_request(email_request()), "acme", now_ms=day_ago) for _ in range(2)]
    worker, consumer, producer, provider = _worker([FakeMessage(0, i, encode(s)) for i, s in enumerate(sends)],
                                                   jobs=FakeJobs(delivered={sends[0].send_id}))
    _run(worker)
    assert provider.sent == []
    [(_, headers)] = producer.records[NAMES.dlq]
    assert headers["send_id"] == sends[1].send_id.encode() and headers["reason"] == b"too_old"
    assert consumer.stored[(TOPIC, 0)] == 2


@pytest.mark.parametrize("state", ["inflight:send-x", "reconcile"])
def test_an_expired_send_whose_earlier_request_has_no_known_outcome_is_dead_lettered_unknown_outcome(state):
    """Given a send older than its policy allows, still claimed by a request whose outcome is unknown (or left
    to reconciliation),
    When a worker meets it,
    Then nothing is sent and it is dead-lettered `unknown_outcome` (before: `too_old`, which the runbook
    says may be replayed after fixing the cause: the provider may hold it, and a replay would send it again)."""
    day_ago = int(time.time() * 1000) - 86_400_000
    send = build_send(validate_request(email_request()), "acme", now_ms=day_ago)
    jobs = FakeJobs()
    jobs.state[send.send_id] = state
    worker, consumer, producer, provider = _worker([FakeMessage(0, 0, encode(send))], jobs=jobs)
    _run(worker)
    assert provider.sent == []
    [(_, headers)] = producer.records[NAMES.dlq]
    assert headers["reason"] == b"unknown_outcome" and consumer.stored[(TOPIC, 0)] == 1


class CoolDowns(FakeGate):
    def __init__(self):
        super().__init__()
        self.cooled: list[tuple[str, float]] = []

    def cool_down(self, provider, seconds, tenant=None):
        self.cooled.append((provider, seconds, tenant))


@pytest.mark.parametrize("keys, everyone_held", [({"*": "re_shared", "acme": "re_acme_own"}, False),
                                                 ({"*": "re_shared"}, True),
                                                 ({"*": "re_shared", "acme": "re_shared"}, True)],
                         ids=["acme's own account", "one shared account", "acme named on the shared key"])
def test_a_429_from_a_tenants_own_account_holds_that_tenant_only(keys, everyone_held):
    """Given email sent under one provider key for everyone, or under a key of acme's own (its own account,
    with its own limits),
    When acme's request is answered 429 (its account's daily quota, say) with Retry-After 2 s,
    Then on its own account acme's queue is held, its own account's cool-down is set (every worker sending under
    it, of both lanes, holds off; before, only the worker that met the 429) and globex's email goes out; on the
    shared account every worker holds off the provider (the shared cool-down), as before."""
    spec = load_registry().primary("email")
    sends, msgs = _messages(["acme", "globex"])
    answers = [ProviderResult("throttled", 429, retry_after="2", error_name="rate_limit_exceeded")]
    provider, gate = FakeProvider(DELIVERED), CoolDowns()
    provider.post = lambda *args: (provider.sent.append(args[1]), answers.pop(0) if answers else DELIVERED)[1]
    worker = LaneWorker(WorkerConfig("email", "transactional", "unused:9092", spec, NAMES), FakeConsumer(msgs[:1]),
                        FakeProducer(), Routes([Route(spec, provider, ProviderCredentials(keys))]), gate, FakeJobs(),
                        load_policies())
    worker.consumer.subscribe([TOPIC], on_assign=worker._on_assign)
    _run(worker, steps=5)
    worker.consumer.pending.append(msgs[1])
    _run(worker, steps=5)
    assert [(p, round(s), t) for p, s, t in gate.cooled] == [("resend", 2, None if everyone_held else "acme")]
    if not everyone_held:
        assert provider.sent == [sends[0].send_id.encode(), sends[1].send_id.encode()]
        assert worker.queues.buffered == 1  # acme's, held until its Retry-After


class OwnAccountDry(FakeGate):
    """acme sends under its own provider account, whose global bucket is dry (the gate answers `global`)."""

    def acquire(self, provider, tenant, messages, reserve=False):
        if tenant == "acme":
            return Admission(False, 30.0, "global")
        return super().acquire(provider, tenant, messages, reserve)


@pytest.mark.parametrize("keys, everyone_held", [({"*": "re_shared", "acme": "re_acme_own"}, False),
                                                 ({"*": "re_shared"}, True)],
                         ids=["acme's own account", "one shared account"])
def test_a_dry_bucket_of_a_tenants_own_account_holds_that_tenant_only(keys, everyone_held):
    """Given acme's email denied by the gate for 30 s on a global bucket: its own account's, or the one everyone
    shares,
    When globex's email arrives next,
    Then on its own account only acme is held and globex's email goes out at once; on the shared bucket every
    queue waits, as before (before the fix: acme's own account held every tenant of the worker for 30 s)."""
    spec = load_registry().primary("email")
    sends, msgs = _messages(["acme", "globex"])
    provider = FakeProvider(DELIVERED)
    worker = LaneWorker(WorkerConfig("email", "transactional", "unused:9092", spec, NAMES), FakeConsumer(msgs[:1]),
                        FakeProducer(), Routes([Route(spec, provider, ProviderCredentials(keys))]), OwnAccountDry(),
                        FakeJobs(), load_policies())
    worker.consumer.subscribe([TOPIC], on_assign=worker._on_assign)
    _run(worker, steps=5)
    worker.consumer.pending.append(msgs[1])
    _run(worker, steps=5)
    assert provider.sent == ([] if everyone_held else [sends[1].send_id.encode()])
    assert worker.queues.buffered == (2 if everyone_held else 1)


class StrictBatches(FakeProvider):
    """Refuses a batch whole when it holds the one email it will not take (strict batch mode: an unverified sender
    domain, say), or, with status 413, any batch (its size); alone, every other email is accepted."""

    def __init__(self, refused: str, status: int):
        super().__init__(DELIVERED)
        self.refused, self.status = refused.encode(), status

    def post(self, path, body, api_key, idempotency_key):
        self.sent.append(body)
        if (body.count(b"|") > 0 and self.status == 413) or self.refused in body:
            return ProviderResult(classify(self.status, "validation_error"), self.status,
                                  error_name="validation_error")
        return DELIVERED


@pytest.mark.parametrize("status", [413, 422])
def test_a_batch_refused_for_its_size_is_sent_again_one_send_a_request(status):
    """Given three marketing emails of one tenant,
    When they go out in one batch and the provider refuses the batch whole for its size (413),
    Then each is sent again alone, at once, and delivered (before: all three were dead-lettered permanent_error,
    never sent); a batch refused for what one message holds (422 in strict batch mode) is dead-lettered whole, as
    before, in one request: split, a blast whose every message is refused would spend a request per message of
    the budget every tenant shares."""
    sends = [build_send(validate_request(email_request("marketing")), "acme") for _ in range(3)]
    msgs = [FakeMessage(0, i, encode(s)) for i, s in enumerate(sends)]
    provider, gate = StrictBatches(sends[0].send_id if status == 422 else "none", status), FakeGate()
    worker, consumer, producer, _ = _worker(msgs, lane="marketing", provider=provider, gate=gate)
    _run(worker)
    dead = {h["send_id"] for _, h in producer.records.get(NAMES.dlq, [])}
    assert dead == (set() if status == 413 else {s.send_id.encode() for s in sends})
    assert len(provider.sent) == (4 if status == 413 else 1) and consumer.stored[(TOPIC, 0)] == 3
    # acme is charged once for each email, not again for those the provider sent back unread (413)
    assert gate.spent[("resend", "acme", "messages")] == 3


class SharedAccountDenied(FakeGate):
    """The account everyone shares is denied (a cool-down of an hour after a quota 429, or its global bucket dry);
    acme's own account is not (the gate reads acme's own cool-down key and buckets, and admits it)."""

    def __init__(self, short: str):
        super().__init__()
        self.short = short

    def acquire(self, provider, tenant, messages, reserve=False):
        if tenant != "acme":
            return Admission(False, 3600.0 if self.short == "cooldown" else 30.0, self.short)
        return super().acquire(provider, tenant, messages, reserve)


@pytest.mark.parametrize("short", ["cooldown", "global"])
def test_a_denial_of_the_shared_account_does_not_hold_a_tenant_with_its_own_account(short):
    """Given email sent under the shared key for globex and under a key of acme's own, and globex's email denied by
    the gate on the shared account (its cool-down, or its global bucket),
    When acme's OTP arrives next,
    Then it goes out at once, and globex's stays held (before: the shared account's denial held every queue of the
    worker, acme's too: up to 10 s a round all through an hour's cool-down, up to 60 s on a dry bucket)."""
    spec = load_registry().primary("email")
    sends, msgs = _messages(["globex", "acme"])
    provider = FakeProvider(DELIVERED)
    keys = ProviderCredentials({"*": "re_shared", "acme": "re_acme_own"})
    worker = LaneWorker(WorkerConfig("email", "transactional", "unused:9092", spec, NAMES), FakeConsumer(msgs[:1]),
                        FakeProducer(), Routes([Route(spec, provider, keys)]), SharedAccountDenied(short), FakeJobs(),
                        load_policies())
    worker.consumer.subscribe([TOPIC], on_assign=worker._on_assign)
    _run(worker, steps=5)
    worker.consumer.pending.append(msgs[1])
    _run(worker, steps=5)
    assert provider.sent == [sends[1].send_id.encode()]
    assert worker.queues.buffered == 1  # globex's, held


class KeyRefusedFor(FakeProvider):
    """The provider refuses one key (a tenant's own, revoked) and takes every other."""

    def __init__(self, refused: str):
        super().__init__(DELIVERED)
        self.refused = refused

    def post(self, path, body, api_key, idempotency_key):
        self.sent.append(body)
        return ProviderResult("auth", 401, error_name="invalid_api_key") if api_key == self.refused else DELIVERED


class NoLimitFor(FakeGate):
    """No rate limit is set for one tenant, nor a default ('*')."""

    def __init__(self, tenant: str):
        super().__init__()
        self.tenant = tenant

    def tenant_limit(self, provider, tenant):
        if tenant == self.tenant:
            raise ConfigError(f"no limit for tenant {tenant!r} at provider {provider!r} and no default ('*')")
        return super().tenant_limit(provider, tenant)


class GateRefuses(FakeGate):
    """The gate's own look at one tenant's requests answers `error`: no limit (its provider's global limit unset: a
    fallback provider given only a default tenant limit, though a tenant limit was read), or its buckets
    unreadable."""

    def __init__(self, tenant: str, error: Exception):
        super().__init__()
        self.tenant, self.error = tenant, error

    def acquire_many(self, requests):
        return [self.error if r[1] == self.tenant else self.acquire(*r) for r in requests]


@pytest.mark.parametrize("case", ["its own key refused", "no limit for it", "its buckets unreadable"])
def test_a_tenant_held_for_long_does_not_pin_the_partition_for_every_other_tenant(case):
    """Given acme's email first on a partition, then 150 of globex's, and acme's sends held for long: the provider
    refuses acme's own key (401 after a fresh one), or no operator set a limit acme falls under,
    When the worker runs,
    Then globex's 150 are sent, acme's send is parked on a retry tier (not an attempt) due when the hold ends, and
    the partition's offset moves past all 151 (before: acme's message stayed in memory, held again and again, and
    pinned the offset: the lane's lag, which makes marketing yield, grew with every other tenant's traffic; a
    tenant without limits was held that way for good, never reaching its max age; one whose buckets the gate
    cannot read, held 5 s at a time, for good too)."""
    sends, msgs = _messages(["acme"] + ["globex"] * 150)
    spec = load_registry().primary("email")
    keys = {"*": "re_shared", "acme": "re_acme_own"}
    provider = KeyRefusedFor("re_acme_own") if case == "its own key refused" else FakeProvider(DELIVERED)
    gate = {"its own key refused": FakeGate(), "no limit for it": NoLimitFor("acme"),
            "its buckets unreadable": GateRefuses("acme", BucketUnreadable("acme's buckets cannot be read"))}[case]
    producer = FakeProducer()
    worker = LaneWorker(WorkerConfig("email", "transactional", "unused:9092", spec, NAMES), FakeConsumer(msgs),
                        producer, Routes([Route(spec, provider, ProviderCredentials(keys))]), gate, FakeJobs(),
                        load_policies())
    worker.consumer.subscribe([TOPIC], on_assign=worker._on_assign)
    _run(worker, steps=60)
    assert {s.send_id.encode() for s in sends[1:]} <= set(provider.sent)
    parked = [h for t, records in producer.records.items() if ".retry." in t for _, h in records]
    reason = b"auth_refused" if case == "its own key refused" else b"misconfigured"
    assert [(h["send_id"], h["retry_reason"], h["attempt"]) for h in parked] == [
        (sends[0].send_id.encode(), reason, b"1")]  # its first attempt: refused, it is not one
    assert worker.queues.buffered == 0 and worker.consumer.stored[(TOPIC, 0)] == 151


def test_the_shared_key_refused_holds_every_tenant_in_memory_and_parks_nothing():
    """Given 20 tenants sending under the one key everyone shares, which the provider refuses (revoked),
    When the worker runs,
    Then every queue waits in memory for PROVIDER_AUTH_HOLD_S, as with a token: nothing is parked on a retry tier
    (parking would send every message of the lane round the tiers every 30 s until the key is cured), and only the
    first requests met the refusal."""
    tenants = [f"t{i}" for i in range(20)]
    sends, msgs = _messages(tenants * 5)
    spec = load_registry().primary("email")
    provider = KeyRefusedFor("re_shared")
    producer = FakeProducer()
    worker = LaneWorker(WorkerConfig("email", "transactional", "unused:9092", spec, NAMES), FakeConsumer(msgs),
                        producer, Routes([Route(spec, provider, ProviderCredentials({"*": "re_shared"}))]),
                        FakeGate(), FakeJobs(), load_policies())
    worker.consumer.subscribe([TOPIC], on_assign=worker._on_assign)
    _run(worker, steps=30)
    assert [t for t in producer.records if ".retry." in t] == []
    assert worker.queues.buffered == 100 and len(provider.sent) <= 20


def test_the_shared_key_refused_holds_the_tenants_whose_sends_arrive_afterwards_too():
    """Given the key every tenant shares refused on globex's request (its queue then held),
    When sends of initech (whose queue was empty at the refusal, sending under the same key) and of acme (a key of
    its own) arrive meanwhile,
    Then initech's wait for the hold's end (before: its new queue went out, met the refusal again and held everyone
    anew), acme's is sent; once the hold has passed and the key is cured, initech's is sent too."""
    sends, msgs = _messages(["globex"])
    worker, producer, provider = _own_key_worker(msgs, refused="re_shared")
    _run(worker, steps=5)
    assert len(provider.sent) == 1
    later = [build_send(validate_request(email_request()), t) for t in ("initech", "acme")]
    worker.consumer.pending.extend(FakeMessage(0, 1 + i, encode(s)) for i, s in enumerate(later))
    _run(worker, steps=5)
    sent_ids = [s.send_id for s in [*sends, *later] if any(s.send_id.encode() in body for body in provider.sent)]
    assert sent_ids == [sends[0].send_id, later[1].send_id]
    assert worker.queues.size("initech") == 1 and worker.queues.size("globex") == 1
    provider.refused = None  # the shared key is cured, and the hold has passed
    worker.dispatcher.routes.primary.shared_account_held_until = 0.0
    for q in worker.queues.queues.values():
        q.ready_at = 0.0
    _run(worker, steps=5)
    assert worker.queues.buffered == 0 and len(provider.sent) == 4


def _own_key_worker(msgs, refused: str, batches: bool = True):
    """An email worker where acme sends under a key of its own ("re_acme_own") and everyone else under "re_shared";
    the provider refuses the key `refused`. `batches=False`: one message a request on every lane."""
    spec = load_registry().primary("email")
    spec = spec if batches else replace(spec, batch_lanes=frozenset())
    provider, producer = KeyRefusedFor(refused), FakeProducer()
    worker = LaneWorker(WorkerConfig("email", "transactional", "unused:9092", spec, NAMES), FakeConsumer(msgs),
                        producer, Routes([Route(spec, provider, ProviderCredentials(
                            {"*": "re_shared", "acme": "re_acme_own"}))]), FakeGate(), FakeJobs(), load_policies())
    worker.consumer.subscribe([TOPIC], on_assign=worker._on_assign)
    return worker, producer, provider


def _holds_of_a_parked_copy_brought_back(worker, producer, queue: str, times: int) -> list[int]:
    """Run the worker until `queue`'s send is parked, note for how long (s), and bring the copy back as the
    retrier would once the hold has passed; `times` times."""
    holds = []
    for _ in range(times):
        _run(worker, steps=5)
        (value, headers), = [r for t, records in producer.records.items() if ".retry." in t for r in records[-1:]]
        holds.append(round((int(headers["due_at_ms"]) - int(time.time() * 1000)) / 1000))
        producer.records.clear()
        worker.settler.long_holds.clear()
        worker.queues.queues[queue].ready_at = 0.0
        worker.dispatcher._limits.clear()  # its limit is read again
        for table in (worker.settler.auth_refusals, worker.dispatcher._misconfigured):  # the hold has ended
            table._held = {q: (n, time.monotonic()) for q, (n, _) in table._held.items()}
        worker.consumer.pending.append(FakeMessage(0, len(holds), value, list(headers.items())))
    return holds


def test_a_tenants_own_key_refused_again_and_again_is_held_longer_each_time():
    """Given acme's own provider key refused, and its send parked for the hold,
    When the parked copy comes back and is refused again, twice,
    Then it is held 30 s, then 60 s, then 120 s (each time parked until then), so a key left refused costs a
    request and a parked copy per doubling hold, not every 30 s; a request of acme's answered otherwise resets it."""
    sends, msgs = _messages(["acme"])
    worker, producer, provider = _own_key_worker(msgs, refused="re_acme_own")
    assert _holds_of_a_parked_copy_brought_back(worker, producer, "acme", times=3) == [30, 60, 120]
    assert len(provider.sent) == 3
    provider.refused = None  # the tenant's key is cured: the copy back is sent, and acme's holds start over
    _run(worker, steps=5)
    assert len(provider.sent) == 4 and len(worker.settler.auth_refusals) == 0 and worker.queues.buffered == 0


def test_a_short_429_or_a_timeout_meanwhile_neither_ends_nor_resets_a_refused_keys_hold():
    """Given acme's own key refused (its queue held 30 s, parked), and another of acme's requests of the same round
    answered 429 with Retry-After 1 s, or timing out,
    When that answer is settled,
    Then acme's hold still runs its 30 s (before: the 429 cut it to 1 s), and its next refusal holds it 60 s (before:
    any answer but a refusal reset the count, so the doubling started over)."""
    for answer in (ProviderResult("throttled", 429, retry_after="1", error_name="rate_limit_exceeded"),
                   ProviderResult("unknown", error_name="ReadTimeout")):
        sends, msgs = _messages(["acme"])
        worker, *_ = _worker(msgs)
        settler = worker.settler
        settler.routes.primary.credentials = ProviderCredentials({"*": "re_shared", "acme": "re_acme_own"})
        refused = ProviderResult("auth", 401, error_name="invalid_api_key")
        settler._unauthorised(settler.routes.primary, Job("k1", "/emails", b"", "acme", (), [], "acme", "resend"),
                              refused, int(time.time() * 1000))
        settler._hold_queue("acme", 1.0, int(time.time() * 1000), asked=True)
        settler.settle(Job("k2", "/emails", b"", "acme", (), [], "acme", "resend"), answer)
        assert worker.queues.queues["acme"].ready_at - time.monotonic() > 25
        assert settler.long_holds["acme"][2] == "auth_refused"
        settler.auth_refusals._held = {q: (n, time.monotonic()) for q, (n, _) in settler.auth_refusals._held.items()}
        assert settler.auth_refusals.hold_for("acme", 30, time.monotonic()) == 60


def test_a_429_settled_again_after_a_redis_error_holds_off_only_what_is_left_of_its_ask():
    """Given a 429 asking for 60 s, answered 30 s ago, whose settlement met a Redis error and is settled again now,
    and one answered 90 s ago,
    When they are settled,
    Then the provider is held off for the 30 s left of the first ask, and not at all for the second (before: the
    whole minute again from now, every worker, OTPs included, held for as long as Redis had been away, again)."""
    sends, msgs = _messages(["acme"])
    gate = CoolDowns()
    worker, *_ = _worker(msgs, gate=gate)
    answer = ProviderResult("throttled", 429, retry_after="60", error_name="rate_limit_exceeded")
    now_ms = int(time.time() * 1000)
    for ago_s in (30, 90):
        worker.settler.settle(Job(f"k{ago_s}", "/emails", b"", "acme", (), [], "acme", "resend"), answer,
                              now_ms - ago_s * 1000)
    [(provider, seconds, tenant)] = gate.cooled
    assert provider == "resend" and 29 < seconds <= 30 and tenant is None


@pytest.mark.parametrize("gate", [NoLimitFor("acme"), GateRefuses("acme", BucketUnreadable("unreadable"))],
                         ids=["no tenant limit", "its buckets unreadable"])
def test_a_tenant_left_without_limits_is_looked_at_less_often_each_time(gate):
    """Given acme with no limit it falls under (read by the worker), or whose buckets the gate cannot read,
    When its parked copy comes back twice to the same answer, then its limit is set (its buckets mended),
    Then it is held 30 s, 60 s, then 120 s (parked each time), and sent once its limit is there (before, a hold
    the gate's answer set started over at 30 s every time: the hold was cleared before the gate was asked)."""
    sends, msgs = _messages(["acme"])
    worker, consumer, producer, provider = _worker(msgs, gate=gate)
    assert _holds_of_a_parked_copy_brought_back(worker, producer, "acme", times=3) == [30, 60, 120]
    assert provider.sent == []
    gate.tenant = None  # an operator sets acme's limit
    _run(worker, steps=5)
    assert len(provider.sent) == 1 and len(worker.dispatcher._misconfigured) == 0


def test_a_tenant_without_a_provider_key_keeps_its_order_when_its_requests_of_a_round_go_back():
    """Given 250 of acme's emails and no provider key acme falls under (only globex has one), its burst covering
    three requests of one round,
    When the worker runs,
    Then acme's sends are parked on a retry tier in the order they were published (before: the round's three
    requests went back to the queue's front one after the other, so they were parked last request first)."""
    sends, msgs = _messages(["acme"] * 250)
    worker, consumer, producer, provider = _worker(msgs, gate=FakeGate(bursts={"acme": 1000}))
    worker.routes.primary.credentials = ProviderCredentials({"globex": "re_globex"})
    _run(worker, steps=10)
    parked = [h for t, records in producer.records.items() if ".retry." in t for _, h in records]
    assert [h["retry_reason"] for h in parked] == [b"misconfigured"] * 250
    assert [h["send_id"] for h in parked] == [s.send_id.encode() for s in sends]
    assert provider.sent == []


def test_in_one_queue_for_everyone_a_tenant_without_a_provider_key_puts_back_only_its_own_request():
    """Given the FIFO baseline (one queue for every tenant): acme's email (no provider key it falls under), then
    globex's (a key of its own), drawn in one round,
    When the worker runs,
    Then globex's is sent once and never parked, and only acme's is parked (before: the round put back every
    request of the queue acme's came from, globex's too, which was then sent and parked as well)."""
    sends, msgs = _messages(["acme", "globex"])
    worker, consumer, producer, provider = _worker(msgs, gate=FakeGate(bursts={"acme": 1000}))
    worker.queues.queue_key = lambda send: "all"
    worker.routes.primary.credentials = ProviderCredentials({"globex": "re_globex"})
    _run(worker, steps=10)
    parked = [h["send_id"] for t, records in producer.records.items() if ".retry." in t for _, h in records]
    assert parked == [sends[0].send_id.encode()]
    assert len(provider.sent) == 1 and sends[1].send_id.encode() in provider.sent[0]


def test_a_growing_hold_doubles_up_to_a_quarter_of_an_hour_and_is_forgotten_long_after():
    """Holds in a row double, up to 15 minutes; met again while its hold runs, a queue's reason is the same
    incident (the hold left); long after its last hold ended, it starts over, and queues met long ago are dropped."""
    from streams.dispatch.growing_holds import GrowingHolds, growing_hold

    assert [growing_hold(30, n) for n in (1, 2, 3, 5, 6, 60)] == [30, 60, 120, 480, 900, 900]
    assert growing_hold(1200, 3) == 1200  # a first hold past the cap is not shortened
    holds = GrowingHolds()
    assert holds.hold_for("acme", 30, now=0) == 30
    assert holds.hold_for("acme", 30, now=10) == 20  # the other requests of the round: the same incident
    assert holds.hold_for("acme", 30, now=30) == 60
    assert holds.hold_for("gone", 30, now=30) == 30
    assert holds.hold_for("acme", 30, now=90 + 1801) == 30  # long after: starts over; "gone" is dropped
    assert len(holds) == 1


def test_the_first_refusal_of_a_tenants_own_key_holds_it_30_s_however_many_requests_met_it():
    """Given 10 of acme's sends under its own key, refused, 8 requests in flight at once (the worker's concurrency),
    When all 8 are refused,
    Then acme is held 30 s, once (before: each refusal counted as one more in a row: a first hold of 15 minutes,
    and its OTPs dead-lettered `too_old` for a key that failed for a moment)."""
    sends, msgs = _messages(["acme"] * 10)
    worker, producer, provider = _own_key_worker(msgs, refused="re_acme_own", batches=False)
    _run(worker, steps=5)
    parked = [h for t, records in producer.records.items() if ".retry." in t for _, h in records]
    dues = {round((int(h["due_at_ms"]) - int(time.time() * 1000)) / 1000) for h in parked}
    assert len(provider.sent) >= 2 and len(parked) == 10 and dues <= {29, 30}


def test_the_shared_key_refused_holds_no_tenant_sending_under_a_key_of_its_own():
    """Given globex under the shared key, which the provider refuses, and acme's 40 sends under its own key,
    When the worker runs,
    Then all of acme's are sent (before: every refusal of the shared key held acme's queue too, 30 s at a time)."""
    sends, msgs = _messages(["globex"] * 10 + ["acme"] * 40)
    worker, _, provider = _own_key_worker(msgs, refused="re_shared", batches=False)
    _run(worker, steps=60)
    assert {s.send_id.encode() for s in sends[10:]} <= set(provider.sent)


class RefreshCounting(FakeGate):
    def __init__(self):
        super().__init__()
        self.refreshes = 0

    def refresh_cool_downs(self):
        self.refreshes += 1


def test_a_worker_with_nothing_to_send_still_lets_its_gate_look_at_the_cool_downs_it_knows():
    """What clears the exported cool-down of an idle worker once an operator ended it (ProviderCoolingDown) is the
    gate's own look at Redis: the worker gives it the chance on every step, sends or not."""
    gate = RefreshCounting()
    worker, *_ = _worker([], gate=gate)
    for _ in range(3):
        worker.step()
    assert gate.refreshes == 3


class DeadLettersNeverAcknowledged(FakeProducer):
    """A producer whose DLQ writes all fail after leaving (the DLQ unwritable: an ACL, no replicas in sync)."""

    def produce(self, topic, value=None, key=None, headers=None, on_delivery=None):
        if topic != NAMES.dlq:
            return super().produce(topic, value, key, headers, on_delivery)
        from confluent_kafka import KafkaError
        self._acks.append((lambda err, msg: on_delivery(KafkaError(KafkaError._MSG_TIMED_OUT), msg),
                           FakeMessage(0, 0, value)))


def test_copies_the_broker_does_not_acknowledge_count_against_the_buffer():
    """Given a worker allowed 5 messages in memory whose dead letters the broker never acknowledges,
    When 10 unreadable events arrive,
    Then it pauses its partitions (backpressure) rather than read on while the unacknowledged copies, payload
    and all, pile up in memory without a bound (before: nothing was queued for dispatch, so it read on)."""
    spec = load_registry().primary("email")
    consumer = FakeConsumer([FakeMessage(0, i, b"not json") for i in range(10)])
    worker = LaneWorker(WorkerConfig("email", "transactional", "unused:9092", spec, NAMES, max_buffered=5), consumer,
                        DeadLettersNeverAcknowledged(), Routes([Route(spec, FakeProvider(DELIVERED),
                                                                      ProviderCredentials({"*": "re_key"}))]),
                        FakeGate(), FakeJobs(), load_policies())
    worker.consumer.subscribe([TOPIC], on_assign=worker._on_assign)
    for _ in range(5):
        worker.step()
    assert worker.records.writer.pending == 10 and worker.queues.buffered == 0
    assert "backpressure" in worker.pauses.reasons
    assert consumer.stored.get((TOPIC, 0), 0) == 0  # and nothing unacknowledged is committed past


def test_large_sends_pause_the_partitions_by_their_bytes_long_before_their_count_would():
    """Given a worker allowed 20,000 messages or 100 KiB of them in memory, and a tenant held by its bucket,
    When 10 sends of 20 KiB each arrive (a blast of HTML emails: 200 KiB, 10 messages),
    Then it pauses its partitions (backpressure) rather than read on (before: only the count paused, so sends of
    up to 1 MiB could fill 20 GiB, twice that in memory, and the pod was killed and read them all again)."""
    sends = [build_send(validate_request(email_request(html="x" * 20 * 1024)), "held") for _ in range(10)]
    spec = load_registry().primary("email")
    consumer = FakeConsumer([FakeMessage(0, i, encode(s)) for i, s in enumerate(sends)])
    config = WorkerConfig("email", "transactional", "unused:9092", spec, NAMES, max_buffered_bytes=100 * 1024)
    worker = LaneWorker(config, consumer, FakeProducer(), Routes([Route(spec, FakeProvider(DELIVERED),
                                                                        ProviderCredentials({"*": "re_key"}))]),
                        FakeGate(short_tenants={"held"}), FakeJobs(), load_policies())
    worker.consumer.subscribe([TOPIC], on_assign=worker._on_assign)
    for _ in range(5):
        worker.step()
    assert worker.queues.buffered == 10 and worker.queues.buffered_bytes > 200 * 1024
    assert "backpressure" in worker.pauses.reasons


class OutcomesUnacknowledged(FakeProducer):
    """A producer that never hears back about outcome records (the broker stalled on that topic)."""

    def produce(self, topic, value=None, key=None, headers=None, on_delivery=None):
        if topic == NAMES.outcomes:
            self.records[topic].append((value, dict(headers or [])))  # queued, never acknowledged
            return
        super().produce(topic, value, key, headers, on_delivery)


def test_a_dead_letter_is_finished_once_its_status_is_acknowledged_too():
    """Given a send the provider rejects for good, and a broker that acknowledges the dead letter but not the
    outcome that tells the status store where the letter is,
    When the worker settles it,
    Then its offset is not stored past it: killed now, the send is read again and its status is written,
    instead of showing `retrying` for good (which a replay refuses as still in progress)."""
    sends, msgs = _messages(["acme"])
    spec = load_registry().primary("email")
    consumer, producer = FakeConsumer(msgs), OutcomesUnacknowledged()
    worker = LaneWorker(WorkerConfig("email", "transactional", "unused:9092", spec, NAMES), consumer, producer,
                        Routes([Route(spec, FakeProvider(ProviderResult("rejected", 422, error_name="validation_error")),
                                      ProviderCredentials({"*": "re_key"}))]), FakeGate(), FakeJobs(), load_policies())
    worker.consumer.subscribe([TOPIC], on_assign=worker._on_assign)
    for _ in range(20):
        worker.step()
    assert len(producer.records[NAMES.dlq]) == 1 and len(producer.records[NAMES.outcomes]) >= 1
    assert consumer.stored.get((TOPIC, 0), 0) == 0


def test_a_receiver_timing_out_keeps_what_it_can_attempt_within_the_horizon_and_the_rest_is_parked():
    """Given a worker whose queues are receivers (2 requests in flight per receiver, a one-second horizon, as the
    transactional lane's), tenant A's receiver failing every delivery after 10 s (a timeout), A's bucket letting
    1,000 a second go,
    When A's first delivery has failed and 30 more arrive for that receiver, then tenant B's 5,
    Then the receiver keeps what it can attempt (one at a time, one per 10 s) and the other 29 are parked, due back
    10 s apart, so the partition's offset moves past them and B's deliveries go out. Before, all 30 stayed in the
    worker, sized by A's bucket: an attempt each 10 s, the oldest pinning the committed offset for 5 minutes,
    counted as transactional lag that paused every tenant's marketing."""
    def delivery(tenant: str):
        return build_send(validate_request({**email_request(), "correlation_id": f"{tenant}-receiver"}), tenant)

    sends = [delivery("a") for _ in range(31)] + [delivery("b") for _ in range(5)]
    msgs = [FakeMessage(0, i, encode(s)) for i, s in enumerate(sends)]
    timed_out = ProviderResult("unavailable", error_name="Timeout", latency_s=10.0)
    worker, consumer, producer, provider = _worker(msgs[:1])
    worker.queues.queue_key = lambda send: f"{send.tenant_id}/{send.correlation_id}"
    worker.dispatcher.per_queue = 2
    worker.backlog = BacklogShare(horizon_s=1.0)
    provider.post = lambda *args: (provider.sent.append(args[1]),
                                   timed_out if args[1].decode() in {s.send_id for s in sends[:31]} else DELIVERED)[1]
    _run(worker, steps=3)
    consumer.pending.extend(msgs[1:])
    _run(worker, steps=20)
    parked = [h for topic, records in producer.records.items() if ".retry." in topic for _, h in records
              if h.get("spilled") == b"1"]
    assert len(parked) == 29
    dues = sorted(int(h["due_at_ms"]) for h in parked)
    assert all(9_900 <= later - earlier <= 10_100 for earlier, later in itertools.pairwise(dues))
    assert {s.send_id.encode() for s in sends[31:]} <= set(provider.sent)
    assert consumer.stored[(TOPIC, 0)] == 36


def test_a_tenant_over_its_bucket_parks_its_endpoints_deliveries_in_one_line_of_turns():
    """Given a worker whose queues are receivers, tenant A throttled to 5 a second (burst 5, a one-second horizon),
    its 40 deliveries alternating between two healthy receivers,
    When they arrive,
    Then the deliveries parked are due back one turn of A's bucket (1/5 s) apart across both receivers, not each
    receiver's line on its own (two deliveries due at each moment, back twice too early and parked again)."""
    def delivery(i: int):
        return build_send(validate_request({**email_request(), "correlation_id": f"receiver-{i % 2}"}), "a")

    sends = [delivery(i) for i in range(40)]
    msgs = [FakeMessage(0, i, encode(s)) for i, s in enumerate(sends)]
    worker, consumer, producer, provider = _worker(msgs, gate=FakeGate(rates={"a": 5}, bursts={"a": 5}))
    worker.queues.queue_key = lambda send: f"{send.tenant_id}/{send.correlation_id}"
    worker.dispatcher.per_queue = 2
    worker.backlog = BacklogShare(horizon_s=1.0)
    _run(worker, steps=3)
    dues = sorted(int(h["due_at_ms"]) for topic, records in producer.records.items() if ".retry." in topic
                  for _, h in records if h.get("spilled") == b"1")
    assert len(dues) >= 20
    assert all(later - earlier >= 190 for earlier, later in itertools.pairwise(dues)), dues


def _worker_reading(consumer, provider=None):
    """A transactional email worker subscribed through `consumer` (assigned at its first poll)."""
    spec = load_registry().primary("email")
    worker = LaneWorker(WorkerConfig("email", "transactional", "unused:9092", spec, NAMES), consumer,
                        FakeProducer(), Routes([Route(spec, provider or FakeProvider(DELIVERED),
                                                      ProviderCredentials({"*": "k"}))]),
                        FakeGate(), FakeJobs(), load_policies())
    worker.consumer.subscribe([TOPIC], on_assign=worker._on_assign)
    return worker


class RevokeAfterPoll(BatchedConsumer):
    """A consumer whose `consume` after a poll that returned a message serves a revoke of partition 1 (as
    librdkafka may), once asked to."""

    def __init__(self, batches, worker_of):
        super().__init__(batches)
        self.worker_of, self.revoke_next = worker_of, False

    def consume(self, num_messages=1, timeout=0):
        if num_messages > 1 and self.revoke_next:
            self.revoke_next = False
            self.worker_of()._on_revoke(self, [_TP(TOPIC, 1)])
            return []
        return super().consume(num_messages, timeout)


def test_a_revoke_served_after_the_poll_returned_a_message_stores_no_offset_past_it():
    """Given a worker that has delivered partition 1's send at offset 39 (nothing of it unfinished),
    When its next poll returns the send at offset 40 and the consume after that poll serves partition 1's revoke,
    Then the offset stored for partition 1 is 40, so the partition's new owner reads that send:
    this worker drops it (it no longer owns it); before, the consumer's position (41) was stored, skipping the
    send for good."""
    sends = [build_send(validate_request(email_request()), "acme") for _ in range(2)]
    holder: list = []
    consumer = RevokeAfterPoll([[FakeMessage(1, 39, encode(sends[0]))]], lambda: holder[0])
    provider = FakeProvider(DELIVERED)
    worker = _worker_reading(consumer, provider)
    holder.append(worker)
    _run(worker)
    assert consumer.stored[(TOPIC, 1)] == 40 and len(provider.sent) == 1

    consumer.batches.append([FakeMessage(1, 40, encode(sends[1]))])
    consumer.revoke_next = True
    _run(worker)
    assert consumer.stored[(TOPIC, 1)] == 40 and consumer.positions[1] == 41
    assert len(provider.sent) == 1 and (TOPIC, 1) not in worker.tracker.committable()



def test_a_short_429_answered_after_its_partition_was_lost_does_not_dispatch_the_send_here_again():
    """Given a send whose request is out when its partition is lost (no drain: another worker owns it now),
    When the provider answers a short 429 (the sends would go back to the front of their queue),
    Then the send is not put back nor sent again by this worker: the partition's new owner reads it again
    (before: it was dispatched here too, and both workers could start a retry chain for it)."""
    sends, msgs = _messages(["acme"])
    throttled = ProviderResult("throttled", 429, retry_after="0", error_name="rate_limit_exceeded")
    worker, consumer, producer, provider = _worker(msgs, provider=HeldProvider(throttled))
    for _ in range(5):
        worker.step()
    assert len(worker.dispatcher.in_flight) == 1
    worker._on_lost(consumer, [_TP(TOPIC, 0)])
    provider.answer_all({sends[0].send_id})
    for _ in range(20):
        worker.step()
    assert len(provider.sent) == 1 and worker.queues.buffered == 0 and not worker.dispatcher.in_flight
    assert not any(".retry." in t or t == NAMES.dlq for t in producer.records)


class RevokeInPoll(BatchedConsumer):
    """A consumer whose poll serves a revoke of partition 1 (before it returns anything), once asked to."""

    def __init__(self, batches, worker_of):
        super().__init__(batches)
        self.worker_of, self.revoke_next = worker_of, False

    def poll(self, timeout=0):
        if self.revoke_next:
            self.revoke_next = False
            self.worker_of()._on_revoke(self, [_TP(TOPIC, 1)])
            return None
        return super().poll(timeout)


def test_a_revoke_served_in_the_poll_stores_the_position_past_trailing_transaction_markers():
    """Given a worker that has delivered partition 1's send at offset 39, and a transaction's commit marker at 40
    (the consumer's position is 41; a marker is never returned),
    When the next poll serves partition 1's revoke (every message returned before is tracked),
    Then the offset stored is the position, 41, so the partition's lag reaches 0 (stopping at 40 would leave it
    at 1 until new sends arrive, and a yielding marketing lane waiting for 0 would wait with it)."""
    sends = [build_send(validate_request(email_request()), "acme")]
    holder: list = []
    consumer = RevokeInPoll([[FakeMessage(1, 39, encode(sends[0]))]], lambda: holder[0])
    worker = _worker_reading(consumer)
    holder.append(worker)
    _run(worker)
    consumer.positions[1] = 41
    consumer.revoke_next = True
    worker.step()
    assert consumer.stored[(TOPIC, 1)] == 41


class FailingAfterPoll(BatchedConsumer):
    """A consumer whose consume after a poll that returned a message fails (a fatal error), once asked to."""

    fail_next = False

    def consume(self, num_messages=1, timeout=0):
        if num_messages > 1 and self.fail_next:
            from confluent_kafka import KafkaError, KafkaException
            raise KafkaException(KafkaError(KafkaError._FATAL, "fatal (test)"))
        return super().consume(num_messages, timeout)


def test_a_worker_whose_consume_fails_after_the_poll_returned_a_message_stores_no_offset_past_it():
    """Given a worker that has delivered partition 1's send at offset 39,
    When its next poll returns the send at offset 40 and the consume after that poll fails, stopping the worker,
    Then the offset it stores on the way out is 40: the send is read again (before: the position, 41, skipping it
    for good)."""
    sends = [build_send(validate_request(email_request()), "acme") for _ in range(2)]
    consumer = FailingAfterPoll([[FakeMessage(1, 39, encode(sends[0]))]])
    provider = FakeProvider(DELIVERED)
    worker = _worker_reading(consumer, provider)
    _run(worker)
    assert consumer.stored[(TOPIC, 1)] == 40
    consumer.batches.append([FakeMessage(1, 40, encode(sends[1]))])
    consumer.fail_next = True
    from confluent_kafka import KafkaException
    with pytest.raises(KafkaException):
        worker.run()
    assert consumer.stored[(TOPIC, 1)] == 40 and consumer.positions[1] == 41 and len(provider.sent) == 1


def test_a_partition_nothing_was_read_from_stores_its_position_past_trailing_transaction_markers():
    """Given a worker assigned partitions 0 and 1, with sends on partition 0 only, and partition 1's position past a
    transaction's commit marker its previous owner had not committed past (41; a marker is never returned),
    When the worker runs,
    Then partition 1's stored offset is 41, so its lag reaches 0 (before: nothing was stored for it until a send
    arrived there, and its lag stayed 1: a marketing lane yielding until the lag is 0 would have waited with it)."""
    sends, msgs = _messages(["acme"])
    consumer = BatchedConsumer([msgs])
    consumer.positions[1] = 41
    worker = _worker_reading(consumer)
    _run(worker)
    assert consumer.stored[(TOPIC, 0)] == 1 and consumer.stored[(TOPIC, 1)] == 41


def test_a_revoke_after_the_first_poll_of_a_partition_stores_nothing_past_its_first_message():
    """Given a worker assigned partitions 0 and 1 that has read nothing of partition 1 yet,
    When a poll returns partition 1's first message (offset 40, the position now 41) and the consume after it
    serves partition 1's revoke,
    Then nothing is stored for partition 1 (its committed offset stays where the new owner starts: at that
    message), although the partition is unknown to this worker's tracking, which otherwise stores the position;
    and a partition whose position is not known yet (-1001) is never stored."""
    sends = [build_send(validate_request(email_request()), "acme") for _ in range(2)]
    holder: list = []
    consumer = RevokeAfterPoll([[FakeMessage(0, 0, encode(sends[0]))]], lambda: holder[0])
    worker = _worker_reading(consumer)
    holder.append(worker)
    _run(worker)
    assert consumer.stored == {(TOPIC, 0): 1}  # partition 1: position unknown (-1001), nothing stored

    consumer.batches.append([FakeMessage(1, 40, encode(sends[1]))])
    consumer.revoke_next = True
    _run(worker)
    assert (TOPIC, 1) not in consumer.stored and consumer.positions[1] == 41


class DownJobs(FakeJobs):
    """processed_jobs whose Redis refuses every read."""

    def status_many(self, groups):
        raise StoreUnavailable("Redis down")


class MarksFailing(FakeJobs):
    """Redis down once the sends are claimed: their `delivered` marks cannot be written."""

    def mark_delivered_many(self, requests):
        raise StoreUnavailable("Redis down")


class OutcomesTimingOut(FakeProducer):
    """The broker away: every outcome record's delivery report says it timed out."""

    def poll(self, timeout=0):
        acks, self._acks = self._acks, []
        for ack, written in acks:
            ack(KafkaError(KafkaError._MSG_TIMED_OUT), written)
        return len(acks)


@pytest.mark.parametrize("waiting", ["marks", "outcomes"])
def test_a_worker_whose_work_waits_out_a_backoff_waits_in_its_poll_instead_of_spinning(waiting):
    """Given a worker whose delivered sends wait out a backoff: their marks (Redis down) or their outcome records
    (the broker away, each produced again after the writer's backoff),
    When it steps on,
    Then each poll waits for the backoff (a new message would still end the wait at once) instead of a
    millisecond (before: some 1,000 steps a second for as long as the outage lasted, a core the transactional
    lane needed); the work is still there."""
    sends, msgs = _messages(["acme"] * 3)
    worker, consumer, producer, provider = _worker(
        msgs, jobs=MarksFailing() if waiting == "marks" else None,
        producer=OutcomesTimingOut() if waiting == "outcomes" else None)
    waits: list[float] = []
    poll = consumer.poll
    consumer.poll = lambda timeout=0: (waits.append(timeout), poll(timeout))[1]
    for _ in range(30):
        worker.step()
    assert len(provider.sent) == 3 and (worker.settler.pending or worker.records.writer.pending)
    assert min(waits[-10:]) > 0.05, waits


class RedisComingBack(FakeJobs):
    """processed_jobs whose Redis refuses everything while `down`."""

    def __init__(self):
        super().__init__()
        self.down = True

    def ping(self):
        if self.down:
            raise StoreUnavailable("Redis down")

    def status_many(self, groups):
        self.ping()
        return super().status_many(groups)


def test_a_yielding_worker_reports_redis_back_once_it_answers():
    """Given a marketing worker that met Redis down while dispatching, then began to yield to the transactional lane
    (whose lag the outage had raised),
    When Redis answers again while it still yields,
    Then `dispatch_dependency_down{dependency="redis"}` goes back to 0 within a back-off (before: only dispatching
    cleared it, so DispatchHoldingForDependency kept paging for Redis until the transactional lane drained)."""
    from prometheus_client import REGISTRY

    def down() -> float | None:
        return REGISTRY.get_sample_value("dispatch_dependency_down",
                                         {"role": "worker.email.marketing", "dependency": "redis"})

    sends, msgs = _messages(["acme"] * 3)
    jobs = RedisComingBack()
    worker, consumer, _, provider = _worker(msgs, lane="marketing", jobs=jobs)
    worker.redis_outage.base_s = worker.redis_outage.cap_s = 0.0  # no waiting between attempts in a unit test
    for _ in range(3):
        worker.step()
    assert down() == 1 and provider.sent == []
    worker.pauses.reasons.add("yield")  # as following a high transactional lag sets it
    jobs.down = False
    for _ in range(3):
        worker.step()
    assert down() == 0 and provider.sent == []  # still yielding: nothing sent


@pytest.mark.parametrize("hold", ["yield", "redis_down"])
def test_a_worker_holding_dispatch_back_waits_in_its_poll_instead_of_spinning(hold):
    """Given a worker with 5 sends queued that holds dispatch back: a marketing lane yielding to the transactional
    lane, or any lane whose Redis is down (between two tries of its back-off),
    When it steps on,
    Then each poll waits (a new message would still end the wait at once) instead of returning at once because
    the queued sends' tenant is ready (before: a 0 s wait, some 50,000 steps a second: a core burnt for as long
    as the hold lasted, while the transactional lane needed it), and nothing is sent."""
    sends, msgs = _messages(["acme"] * 5)
    worker, consumer, _, provider = _worker(msgs, lane="marketing" if hold == "yield" else "transactional",
                                            jobs=DownJobs() if hold == "redis_down" else None)
    if hold == "yield":
        worker.pauses.reasons.add("yield")  # as following a high transactional lag sets it
    waits: list[float] = []
    poll = consumer.poll
    consumer.poll = lambda timeout=0: (waits.append(timeout), poll(timeout))[1]
    for _ in range(4):
        worker.step()
    assert worker.queues.buffered == 5 and provider.sent == []
    assert min(waits[1:]) > 0.05, waits


def test_a_providers_tried_header_names_only_the_channels_providers_in_the_outcome():
    """Given a lane message written by hand whose providers_tried header is 17 kB of names, a channel provider among
    them, repeated,
    When it is delivered,
    Then its outcome names only the channel's providers, each once (before: the header was copied whole into the
    outcome, and a hundred such in one request made a record the broker refused: the worker exited, and again
    after every restart)."""
    send = build_send(validate_request(email_request()), "acme")
    header = ",".join(["resend", "bogus" * 10] * 300).encode()
    worker, consumer, producer, provider = _worker([FakeMessage(0, 0, encode(send), [("providers_tried", header)])])
    _run(worker)
    [(event, _)] = producer.records[NAMES.outcomes]
    assert orjson.loads(event)["providers_tried"] == ["resend"] and consumer.stored[(TOPIC, 0)] == 1


def test_a_new_workers_first_partitions_are_paused_when_its_lane_yields():
    """Given a marketing worker whose lane yields, and a consumer that, like librdkafka, skips a pause of a partition
    not yet assigned (inside on_assign, confluent-kafka assigns only once the callback returns),
    When the worker's first partitions are assigned,
    Then they are paused (before: the pause was skipped and the partitions fetched while the worker reported them
    paused, a blast read and parked while the transactional lane was behind)."""
    from tests.harness import PauseRecordingConsumer

    worker, _, _, _ = _worker([], lane="marketing")
    consumer = PauseRecordingConsumer(assigned_only=True)
    worker.pauses.consumer = consumer  # type: ignore[assignment]
    worker.pauses.reasons.add("yield")
    worker._on_assign(consumer, [_TP(TOPIC, 0), _TP(TOPIC, 1)])
    assert consumer.paused == {(TOPIC, 0), (TOPIC, 1)}


def test_an_adapter_failing_unexpectedly_logs_its_class_and_frames_never_its_text(caplog):
    """Given a provider adapter whose call fails with an exception naming the recipient and a webhook URL (a
    credential for some receivers), raised while handling another that names them too,
    When the worker collects that failure,
    Then its error line names the exception's class, and the traceback the log shows (text or JSON) says where
    both were raised (their classes, frames and lines of code) without their text (before: the text was in the
    traceback, at DEBUG)."""
    import logging

    from streams import logs

    class Failing(FakeProvider):
        def submit(self, path, body, api_key, idempotency_key, tenant):
            done = Future()
            recipient, url = "jane@example.test", "https://hooks.example/T0/B0/s3cret"
            try:
                try:
                    raise KeyError(recipient)
                except KeyError:
                    raise ValueError(f"cannot send to {recipient} via {url}")  # noqa: B904 - on purpose
            except ValueError as exc:
                done.set_exception(exc)
            return done

    sends, msgs = _messages(["acme"])
    worker, _, _, _ = _worker(msgs, provider=Failing(DELIVERED))
    with caplog.at_level(logging.INFO):
        _run(worker, steps=5)
    text = [logs.TextFormatter().format(r) for r in caplog.records]
    as_json = [orjson.loads(logs.JsonFormatter().format(r)) for r in caplog.records]
    failure = next(line for line in text if "provider call failed unexpectedly (ValueError)" in line)
    assert failure.endswith(next(d["exc"] for d in as_json if "exc" in d))  # the JSON line's traceback: the same
    assert "in submit" in failure and 'raise ValueError(f"cannot send to {recipient} via {url}")' in failure
    assert "builtins.ValueError: (its text withheld)" in failure and "builtins.KeyError: (its text withheld)" in failure
    assert not any("jane@example.test" in line or "s3cret" in line for line in text + [orjson.dumps(as_json).decode()])


def test_a_revoke_waits_for_the_revoked_partitions_requests_only():
    """Given a worker with two requests in flight: tenant slow's (a message of partition 0, whose provider has not
    answered) and tenant quick's (partition 1, answered a moment later),
    When partition 1 is revoked (cooperative rebalancing: partition 0 stays),
    Then the revoke waits for quick's request and stores its offset, but not for slow's (before: it waited for every
    request in flight, and the whole group's rebalance with it, for as long as the slowest provider took); slow's
    request is settled when its answer comes, and each send was sent once."""
    import threading

    slow, quick = (build_send(validate_request(email_request()), t) for t in ("slow", "quick"))
    provider = HeldProvider(DELIVERED)
    holder: list = []
    consumer = BatchedConsumer([[FakeMessage(0, 7, encode(slow)), FakeMessage(1, 4, encode(quick))]])
    worker = _worker_reading(consumer, provider)
    holder.append(worker)
    for _ in range(5):
        worker.step()
    requests = {body.decode(): done for body, done in provider.waiting}
    assert set(requests) == {slow.send_id, quick.send_id}
    answer = threading.Timer(0.2, provider.answer_all, [{quick.send_id}])
    # The revoke of the code before this fix returned only once slow's request was answered.
    fallback = threading.Timer(10, provider.answer_all, [{slow.send_id}])
    answer.start()
    fallback.start()
    try:
        worker._on_revoke(consumer, [_TP(TOPIC, 1)])
        assert requests[quick.send_id].done() and not requests[slow.send_id].done()
        assert consumer.stored[(TOPIC, 1)] == 5
    finally:
        fallback.cancel()
    provider.answer_all({slow.send_id})
    _run(worker)
    assert consumer.stored[(TOPIC, 0)] == 8 and len(provider.sent) == 2


class MarksFailingAWhile(FakeJobs):
    """FakeJobs whose delivered marks fail (Redis down) while `down` is above 0, counting down at each try."""

    down = 0

    def mark_delivered(self, tenant, send_ids, key):
        if self.down:
            self.down -= 1
            raise StoreUnavailable("Redis unavailable (test)")
        super().mark_delivered(tenant, send_ids, key)


def test_a_revoke_waits_for_the_outcomes_of_its_own_partitions_only():
    """Given a worker whose send of partition 0 was delivered and whose delivered mark cannot be written yet (Redis
    down), and a partition 1 whose one send waits in its tenant's queue (its bucket empty),
    When partition 1 is revoked (a new worker joins),
    Then the revoke returns at once (before: it waited up to 30 s for partition 0's mark, holding the whole group's
    rebalance; the queued send is its new owner's to read); when partition 0 is revoked, the revoke waits for its
    mark (Redis back), and stores its offset."""
    sends, _ = _messages(["acme", "slow"])
    jobs = MarksFailingAWhile()
    worker, consumer, producer, provider = _worker(
        [FakeMessage(0, 0, encode(sends[0])), FakeMessage(1, 0, encode(sends[1]))], jobs=jobs,
        gate=FakeGate(short_tenants={"slow"}))
    jobs.down = 10**9
    for _ in range(20):
        worker.step()
    assert len(provider.sent) == 1 and worker.settler.pending and worker.tracker.unfinished(TOPIC, 0) == 1
    assert worker.tracker.unfinished(TOPIC, 1) == 1 and worker.queues.buffered == 1
    polls = []
    poll = worker.records.writer.poll
    worker.records.writer.poll = lambda timeout=0: (polls.append(timeout), poll(0))[1]  # type: ignore[method-assign]
    worker._on_revoke(consumer, [_TP(TOPIC, 1)])
    assert polls == [] and worker.settler.pending
    jobs.down = 3
    worker._on_revoke(consumer, [_TP(TOPIC, 0)])
    assert polls and not worker.settler.pending and consumer.stored[(TOPIC, 0)] == 1
