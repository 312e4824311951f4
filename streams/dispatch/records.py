"""What a lane worker writes to Kafka, durably: outcome events (`notif.outcomes`: every attempt and
every terminal outcome), copies for a retry tier, and dead letters (`notif.dlq`, key = send id;
headers: send_id, tenant, channel, lane, reason, attempts, first/last error, origin
topic/partition/offset, group, time).

Records are produced with the idempotent producer (acks=all); `on_ack` runs on the poll thread
once the broker acknowledged a record, which is where the worker finishes offsets. A record the
broker did not acknowledge is produced again with backoff until it is (the offset stays unstored
meanwhile), so a broker outage delays outcomes but never loses or freezes them. A copy the broker
refuses for its size goes to the DLQ instead; a dead letter refused for its size is written
without its payload (its headers name where the original still is), so a poison record never
blocks its partition.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import orjson
from confluent_kafka import KafkaError, Producer

from .. import metrics
from ..kafka_client import AckedWriter, after_all
from ..lanes import RETRY_TIERS
from ..logs import evidence
from ..names import TopicNames
from ..outcomes import (
    OUTCOME_RECORD_BYTES,
    OUTCOMES_PER_RECORD,
    attempt_event,
    dropped_unattempted,
    outcome_event,
)
from ..providers.outcome import ProviderResult, redact
from ..retry.dlq import OWN_DLQ_HEADERS, shown_send_id
from ..retry.policy import RetryAt
from ..send import Send, peek_send_id, plausible_send_id
from .tenant_queues import Pending

log = logging.getLogger("streams.records")
OnAck = Callable[[], object]


# Webhook deliveries given up on without an attempt's answer whose tenant is told ("Webhook event dropped"): too old
# before the attempt, its request's sender stopped before the answer, or its copy (parked while it waited its turn)
# too large for a retry tier. (Not one that could never be a delivery: malformed.)
UNATTEMPTED_DROPS = frozenset({"too_old", "unknown_outcome", "retry_copy_too_large"})


def error_header(result: ProviderResult, channel: str) -> bytes:
    """Status, error name and the (already redacted) body of a provider answer. A webhook receiver's
    body is left out: receivers often echo the event back (personal data no redaction recognises),
    and retry and DLQ headers are read by operators. Nor is it kept anywhere else: the attempts topic, kept 30 days,
    has its status and error name only."""
    body = "" if channel == "webhook" else result.error_body
    return f"{result.status or result.outcome} {result.error_name} {body}".strip().encode()[:1000]


def attempt_info(attempt: int, result: ProviderResult, now_ms: int) -> dict:
    """One attempt of a send, for its history: when, what came back, how long it took."""
    return {"n": attempt, "at_ms": now_ms, "status_code": result.status, "outcome": result.outcome,
            "error": result.error_name, "duration_ms": round(result.latency_s * 1000, 1)}


def outcome_records(events: list[dict]) -> list[bytes]:
    """`{"events": [...]}` values of at most OUTCOMES_PER_RECORD events and, past one event, about
    OUTCOME_RECORD_BYTES: the broker refuses a record over the topic's limit, and the worker could not go on."""
    records = []
    for i in range(0, len(events), OUTCOMES_PER_RECORD):
        chunk = events[i:i + OUTCOMES_PER_RECORD]
        value = orjson.dumps({"events": chunk})
        records.extend([value] if len(value) <= OUTCOME_RECORD_BYTES else _split_by_size(chunk))
    return records


def _split_by_size(events: list[dict]) -> list[bytes]:
    chunks: list[list[bytes]] = [[]]
    size = 0
    for encoded in map(orjson.dumps, events):
        if chunks[-1] and size + len(encoded) > OUTCOME_RECORD_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(encoded)
        size += len(encoded) + 1
    return [b'{"events":[' + b",".join(chunk) + b"]}" for chunk in chunks]


class RecordWriter:
    def __init__(self, producer: Producer, names: TopicNames, channel: str, lane: str, provider: str,
                 topic: str, group: str):
        self.writer = AckedWriter(producer, f"{channel}.{lane}")
        self.names = names
        self.channel, self.lane, self.provider = channel, lane, provider
        self.topic, self.group = topic, group
        self._label = (channel, lane)

    def produce(self, topic: str, key: bytes | None, value: bytes | None, headers: dict, on_ack: OnAck | None = None,
                on_refused: Callable[[KafkaError], object] | None = None,
                on_written: Callable[[int, int], object] | None = None) -> None:
        """Write a record; `on_ack` runs once the broker acknowledged it (it is produced again until then)."""
        self.writer.write(topic, value, key, headers.items(), on_ack, on_refused, on_written)

    # ------------------------------------------------------------------ outcomes and history
    def outcome_event(self, s: Send, status: str, attempts: int | None, now_ms: int, provider_message_id: str = "",
                      reason: str = "", attempt: dict | None = None, tried: list[str] | None = None) -> dict:
        """`tried`: the providers this send was tried on, in order (the last one answered this time)."""
        event = outcome_event(s, status, attempts, now_ms, tried[-1] if tried else self.provider,
                              provider_message_id, reason, attempt)
        if tried:
            event["providers_tried"] = tried
        return event

    @staticmethod
    def origin(p: Pending) -> dict:
        """Where the message was read: a replay of a delivered send finds its payload there."""
        return {"topic": p.topic, "partition": p.partition, "offset": p.offset}

    def delivered_elsewhere_event(self, send_id: str, tenant: str, now_ms: int, provider_message_id: str) -> dict:
        """The outcome of a send settled by a recovered request whose message another consumer holds."""
        return {"send_id": send_id, "tenant_id": tenant, "channel": self.channel, "lane": self.lane,
                "status": "delivered", "attempts": None, "provider": self.provider,
                "provider_message_id": provider_message_id, "reason": "", "completed_at_ms": now_ms}

    def skipped(self, p: Pending, reason: str, now_ms: int, on_ack: OnAck) -> None:
        """A delivery never attempted (its endpoint deleted, disabled or degraded): recorded, not sent."""
        metrics.SENDS.labels(*self._label, "skipped").inc()
        metrics.SKIPPED_DELIVERIES.labels(reason, "worker").inc()
        evidence(log, logging.INFO, "skipped", send_id=p.send.send_id, tenant=p.send.tenant_id, reason=reason)
        self.outcome({**self.outcome_event(p.send, "skipped", p.attempt - 1, now_ms, reason=reason),
                      "origin": self.origin(p)}, on_ack)

    def webhook_attempt(self, p: Pending, result: ProviderResult, now_ms: int, dropped: str = "",
                        on_ack: OnAck | None = None, held: bool = False) -> None:
        """One attempt of a webhook delivery, on the attempts topic (key = endpoint id); `dropped`: the
        delivery was given up after it, for this reason (the dead letter's; false: not given up); `held`: the
        receiver asked to wait a few seconds, and the worker tries the same attempt again after that wait."""
        self._attempt_event(p, {**attempt_info(p.attempt, result, now_ms), "dropped": dropped or False, "held": held},
                            on_ack)

    def webhook_dropped_unattempted(self, p: Pending, reason: str, made: int, now_ms: int, on_ack: OnAck) -> None:
        """A webhook delivery given up on without an attempt of its own (past its max age before it, its request's
        outcome unknown...): said on the attempts topic as well, so that its tenant's members hear of it ("Webhook
        event dropped") as of a delivery dropped after an attempt; `not_attempted`, it never counts as a failure
        of the endpoint."""
        self._attempt_event(p, dropped_unattempted(made, now_ms, reason), on_ack)

    def _attempt_event(self, p: Pending, attempt: dict, on_ack: OnAck | None) -> None:
        """A webhook delivery's event on the attempts topic (key = its endpoint id)."""
        key, event = attempt_event(p.send, attempt)
        self.produce(self.names.webhook_attempts, key, orjson.dumps(event), {}, on_ack)

    def outcome(self, event: dict, on_ack: OnAck | None = None) -> None:
        self.produce(self.names.outcomes, event["send_id"].encode(), orjson.dumps(event), {}, on_ack)

    def outcomes(self, events: list[dict], key: str, on_all_acked: OnAck) -> None:
        """Several events (one provider request's) in as few records as they fit, keyed by the request
        (one event alone: as `outcome`); `on_all_acked` runs once the broker acknowledged every one."""
        if len(events) == 1:
            self.outcome(events[0], on_all_acked)
            return
        values = outcome_records(events)
        if not values:  # no events: nothing to wait for
            on_all_acked()
            return
        remaining = [len(values)]

        def acked() -> None:  # runs inside the producer's poll: it must not raise
            remaining[0] -= 1
            if remaining[0] == 0:
                on_all_acked()

        for value in values:
            self.produce(self.names.outcomes, key.encode(), value, {}, acked)

    # ------------------------------------------------------------------ retry copies
    def retry(self, p: Pending, decision: RetryAt, result: ProviderResult, now_ms: int, on_ack: OnAck,
              tried: list[str] | None = None, kept: bool = False) -> None:
        """A copy of the original bytes for the tier; the payload never changes, and the provider it
        goes to stays the one it was last tried on. `kept`: the send stays claimed by a request the provider may
        hold, to be re-sent byte for byte under its key (said in its event: once Redis lost that request's record,
        `streams state recover` leaves the send to reconciliation; a fresh request could go under another key, a
        batch drawn anew, or after the provider forgot the key)."""
        tried = tried or [self.provider]
        headers = self._retry_headers(p, decision.due_ms, decision.tier, decision.reason, p.attempt + 1)
        if decision.declined or p.declined:  # the next attempt's max_attempts and schedule leave out declined ones
            headers["declined"] = str(p.declined + decision.declined).encode()
        headers["last_error"] = error_header(result, p.send.channel)
        headers.setdefault("first_error", headers["last_error"])
        headers["providers_tried"] = ",".join(tried).encode()
        metrics.RETRIES.labels(*self._label, decision.tier).inc()
        metrics.SENDS.labels(*self._label, "retry").inc()
        evidence(log, logging.WARNING, "retry_scheduled", send_id=p.send.send_id, tenant=p.send.tenant_id,
                 provider=tried[-1], providers_tried=",".join(tried), attempt=p.attempt, tier=decision.tier,
                 due_in_s=round((decision.due_ms - now_ms) / 1000, 1), reason=decision.reason)
        status = "unknown" if result.outcome == "unknown" else "retrying"
        done = after_all(2, on_ack)  # the attempt's outcome (its history) and the copy
        event = self.outcome_event(p.send, status, p.attempt, now_ms, reason=decision.reason,
                                   attempt=attempt_info(p.attempt, result, now_ms), tried=tried)
        if kept:
            event["kept"] = True
        self.outcome(event, done)
        self.produce(self.names.retry(self.channel, self.lane, decision.tier), p.send.tenant_id.encode(), p.raw,
                     headers, done,
                     on_refused=lambda err: self.dead_letter(p, "retry_copy_too_large", result, now_ms, done, tried,
                                                             declined_now=decision.declined))

    def fallback(self, p: Pending, provider: str, tried: list[str], result: ProviderResult, now_ms: int,
                 on_ack: OnAck) -> None:
        """Hand a send the provider rejected for a named fallback reason to the channel's next
        provider: a copy on the first retry tier, due now, naming that provider; the next attempt
        goes through that provider's own bucket."""
        tier = next(iter(RETRY_TIERS))
        headers = self._retry_headers(p, now_ms, tier, f"fallback:{result.error_name}", p.attempt + 1)
        headers.update({"provider": provider.encode(), "providers_tried": ",".join(tried).encode(),
                        "last_error": error_header(result, p.send.channel)})
        headers.setdefault("first_error", headers["last_error"])
        metrics.SENDS.labels(*self._label, "fallback").inc()
        evidence(log, logging.WARNING, "fallback_scheduled", send_id=p.send.send_id, tenant=p.send.tenant_id,
                 provider=tried[-1], to_provider=provider, reason=result.error_name, attempt=p.attempt)
        done = after_all(2, on_ack)  # the attempt's outcome (its history) and the copy
        self.outcome({**self.outcome_event(p.send, "retrying", p.attempt, now_ms, reason=f"fallback:{provider}",
                                           attempt=attempt_info(p.attempt, result, now_ms), tried=tried)}, done)
        self.produce(self.names.retry(self.channel, self.lane, tier), p.send.tenant_id.encode(), p.raw, headers,
                     done, on_refused=lambda err: self.dead_letter(p, "retry_copy_too_large", result, now_ms,
                                                                  done, tried))

    def spill(self, p: Pending, due_ms: int, tier: str, on_ack: OnAck, reason: str = "tenant_backlog") -> None:
        """Park a message on a retry tier until `due_ms`: a tenant's backlog over its share
        (`tenant_backlog`), or an endpoint that asked to be left alone for long (`endpoint_retry_after`).
        Not an attempt: the `attempt` header is unchanged."""
        headers = self._retry_headers(p, due_ms, tier, reason, p.attempt)
        headers["spilled"] = b"1"
        metrics.SPILLED.labels(*self._label).inc()
        self.produce(self.names.retry(self.channel, self.lane, tier), p.send.tenant_id.encode(), p.raw, headers,
                     on_ack, on_refused=lambda err: self.dead_letter(p, "retry_copy_too_large", None,
                                                                    int(time.time() * 1000), on_ack))

    def _retry_headers(self, p: Pending, due_ms: int, tier: str, reason: str, attempt: int) -> dict[str, bytes]:
        return {**p.headers, "send_id": p.send.send_id.encode(), "tenant": p.send.tenant_id.encode(),
                "lane": p.send.lane.encode(), "policy": p.send.policy.encode(), "attempt": str(attempt).encode(),
                "due_at_ms": str(due_ms).encode(), "tier": tier.encode(), "retry_reason": reason.encode(),
                "origin_topic": self.topic.encode()}

    # ------------------------------------------------------------------ dead letters
    def dead_letter(self, p: Pending, reason: str, result: ProviderResult | None, now_ms: int, on_ack: OnAck,
                    tried: list[str] | None = None, detail: str = "", attempted: bool | None = None,
                    declined_now: bool = False) -> None:
        """`attempted`: whether attempt `p.attempt` was made (default: when it has a result); the letter counts
        the attempts made, and of them those a provider declined (`declined_now`: the one just made). Counted in
        dispatch_dead_letters_total once, by the reason it is stored under."""
        made = p.attempt if (result is not None if attempted is None else attempted) else p.attempt - 1
        if p.send.channel == "webhook" and result is None and reason in UNATTEMPTED_DROPS:  # said there as well
            done = after_all(2, on_ack)
            self.webhook_dropped_unattempted(p, reason, made, now_ms, done)
            on_ack = done
        headers = {**p.headers, "send_id": p.send.send_id.encode(), "tenant": p.send.tenant_id.encode(),
                   "channel": p.send.channel.encode(), "lane": p.send.lane.encode(),
                   "reason": reason.encode(), "attempts": str(made).encode(),
                   "origin_topic": p.headers.get("origin_topic", self.topic.encode()),
                   "group": self.group.encode(), "dead_lettered_at_ms": str(now_ms).encode()}
        headers.setdefault("origin_partition", str(p.partition).encode())
        headers.setdefault("origin_offset", str(p.offset).encode())
        if declined_now:
            headers["declined"] = str(p.declined + 1).encode()
        if result is not None:
            headers["last_error"] = error_header(result, p.send.channel)
            headers.setdefault("first_error", headers["last_error"])
        if tried:
            headers["providers_tried"] = ",".join(tried).encode()
        if detail:
            headers["detail"] = redact(detail, 1000).encode()
        metrics.SENDS.labels(*self._label, "dead_lettered").inc()
        evidence(log, logging.WARNING, "dead_lettered", send_id=p.send.send_id, tenant=p.send.tenant_id,
                 provider=tried[-1] if tried else self.provider, providers_tried=",".join(tried or ()),
                 attempts=made, reason=reason, **({"detail": redact(detail, 200)} if detail else {}))
        attempt = attempt_info(p.attempt, result, now_ms) if result is not None else None
        # A webhook delivery that is given up on is "dropped" (the word its receivers' alerts use).
        status = "dropped" if p.send.channel == "webhook" else "dead_lettered"
        event = {**self.outcome_event(p.send, status, made, now_ms, reason=reason, attempt=attempt,
                                      tried=tried),
                 "origin": self.origin(p)}

        def written(partition: int, offset: int) -> None:
            # The status store remembers where the letter is; the message is finished once that is
            # acknowledged too (killed in between, the send would show `retrying` for good, and a replay
            # would refuse it as still in progress).
            self.outcome({**event, "dlq": {"partition": partition, "offset": offset}}, on_ack)

        def written_whole(partition: int, offset: int) -> None:  # refused, it is counted as too_large instead
            metrics.DLQ.labels(*self._label, reason).inc()
            written(partition, offset)

        self.produce(self.names.dlq, p.send.send_id.encode(), p.raw, headers, None,
                     on_refused=lambda err: self._dead_letter_without_payload(p.send.send_id.encode(), headers,
                                                                             None, written),
                     on_written=written_whole)

    def dead_letter_raw(self, msg, headers: dict[str, bytes], reason: str, detail: str, on_ack: OnAck) -> None:
        """An event that never became a send: dead-letter it with the reason; the partition moves on."""
        send_id = plausible_send_id(headers.get("send_id")) or peek_send_id(msg.value())
        evidence(log, logging.WARNING, "dead_lettered", send_id=shown_send_id(send_id.decode(errors="replace")),
                 reason=reason, origin=f"{msg.topic()}[{msg.partition()}]@{msg.offset()}", detail=redact(detail, 200))
        dlq_headers = {**headers, "send_id": send_id, "reason": reason.encode(),
                       "detail": redact(detail, 1000).encode(), "channel": self.channel.encode(),
                       "lane": self.lane.encode(), "origin_topic": msg.topic().encode(),
                       "origin_partition": str(msg.partition()).encode(),
                       "origin_offset": str(msg.offset()).encode(), "group": self.group.encode(),
                       "dead_lettered_at_ms": str(int(time.time() * 1000)).encode()}
        def written_whole() -> None:  # refused, it is counted as too_large instead
            metrics.DLQ.labels(*self._label, reason).inc()
            on_ack()

        self.produce(self.names.dlq, send_id or None, msg.value(), dlq_headers, written_whole,
                     on_refused=lambda err: self._dead_letter_without_payload(send_id or None, dlq_headers, on_ack))

    def _dead_letter_without_payload(self, key: bytes | None, headers: dict[str, bytes], on_ack: OnAck | None,
                                     on_written: Callable[[int, int], object] | None = None) -> None:
        """The broker refused the dead letter for its size: keep the record, without its payload;
        the origin headers say where the original still is (within the lane's retention)."""
        headers = {**headers, "payload_omitted": b"too_large", "reason_detail": headers.get("reason", b"")}
        headers["reason"] = b"too_large"
        metrics.DLQ.labels(*self._label, "too_large").inc()
        self.produce(self.names.dlq, key, None, headers, on_ack, on_written=on_written,
                     on_refused=lambda err: self._dead_letter_with_our_headers_only(key, headers, on_ack, on_written))

    def _dead_letter_with_our_headers_only(self, key: bytes | None, headers: dict[str, bytes], on_ack: OnAck | None,
                                           on_written: Callable[[int, int], object] | None) -> None:
        """Refused even without its payload: the record's own headers are too large. Keep the letter with
        only the headers dispatch writes (bounded), or the partition could never move past it."""
        # Some were copied from the record: bounded here, and a header without a value (None) left out.
        ours = {k: v[:1000] for k, v in headers.items() if k in OWN_DLQ_HEADERS and v is not None}
        ours["headers_omitted"] = b"too_large"
        self.produce(self.names.dlq, key, None, ours, on_ack, on_written=on_written)
