"""Replaying a send: a new delivery, not a retry (`streams sends replay <id>`, `streams dlq replay <id>`).

A retry keeps the send id, so receivers and the provider deduplicate it; a replay is deliberate and
must not be deduplicated away: it gets a completely new send id (and so a new provider idempotency
key), a new creation time (its age starts now), and carries the original id in `replay_of`. The
payload is byte-identical, read from where the send was kept: its dead letter, or, for a send that
was delivered, the lane message that was delivered. Payloads are kept 7 days; after that a replay
fails with an error that says so (the history is kept 30 days, so the error can say when).
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime

from ..errors import (
    MalformedEvent,
    PublishError,
    PublishOutcomeUnknown,
    ReplayOutcomeUnknown,
    ReplayRefused,
    SendTooLarge,
    StoreUnavailable,
)
from ..ingest.publisher import RecordTooLarge
from ..ingest.sdk import SendClient
from ..ingest.status import StatusStore
from ..names import TopicNames
from ..send import Send, decode, new_send_id
from .dlq import PAYLOAD_DAYS, fetch, find

log = logging.getLogger("streams.replay")
PAYLOAD_MS = PAYLOAD_DAYS * 24 * 3600 * 1000
REPLAYABLE = frozenset({"delivered", "dead_lettered", "dropped", "skipped"})


def _when(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M UTC")


def _started(status: dict) -> int:
    return int(status.get("accepted_at_ms") or status.get("completed_at_ms") or 0)


def _payload(bootstrap: str, names: TopicNames, send_id: str, status: dict) -> bytes:
    """The send's original event bytes: its dead letter's, else the delivered lane message's."""
    if status["status"] in ("dead_lettered", "dropped"):
        position = (status["dlq_partition"], status["dlq_offset"]) if "dlq_offset" in status else None
        try:
            record = find(bootstrap, names.dlq, send_id, position)
            if record.value:
                return record.value
        except ReplayRefused:
            pass  # not in the DLQ any more, or written without its payload: try the lane message
    if "origin_offset" in status:
        m = fetch(bootstrap, status["origin_topic"], status["origin_partition"], status["origin_offset"])
        if m is not None and m.value():
            return m.value()
    raise ReplayRefused(f"the payload of send {send_id} has expired: payloads are kept {PAYLOAD_DAYS} days "
                        f"(sent {_when(_started(status))}); nothing is left to send")


def replay(bootstrap: str, names: TopicNames, store: StatusStore, client: SendClient, send_id: str,
           tenant: str | None = None, now_ms: int | None = None) -> Send:
    """Publish a new send with the payload of `send_id` (delivered or dead-lettered); returns it.
    `tenant`, when given, must own the send (a tenant never sees another tenant's sends)."""
    now_ms = now_ms or int(time.time() * 1000)
    status = store.get(send_id)
    if status is None or (tenant is not None and status.get("tenant_id") != tenant):
        raise ReplayRefused(f"no send {send_id} (its history is kept 30 days)")
    if status["status"] not in REPLAYABLE:
        raise ReplayRefused(f"send {send_id} is {status['status']}: only a finished send (delivered, dead-lettered, "
                            "dropped or skipped) can be replayed (one still in progress is retried by dispatch itself)")
    if now_ms - _started(status) > PAYLOAD_MS:
        raise ReplayRefused(f"the payload of send {send_id} has expired: payloads are kept {PAYLOAD_DAYS} days "
                            f"(sent {_when(_started(status))}); nothing is left to send")
    try:
        original = decode(_payload(bootstrap, names, send_id, status))
    except MalformedEvent as exc:
        raise ReplayRefused(f"send {send_id} cannot be replayed: its event is not a valid send "
                            f"({exc.reason}: {exc.detail})") from None
    new = original.model_copy(update={"send_id": new_send_id(now_ms), "created_at_ms": now_ms, "replay_of": send_id})
    try:
        client.publish_sends([new])
    except (RecordTooLarge, SendTooLarge) as exc:  # for good: too large for the topic, or grown by replay_of
        raise ReplayRefused(f"send {send_id} cannot be replayed: {exc}") from None
    except PublishOutcomeUnknown as exc:  # a second replay would be another send id: not deduplicated
        raise ReplayOutcomeUnknown(f"the replay of {send_id} may have been published as {new.send_id} ({exc}); "
                                   f"look it up (`streams sends show {new.send_id}`) before replaying again",
                                   new.send_id) from None
    except PublishError as exc:
        raise PublishError(f"the replay of {send_id} was not published: {exc}") from None
    try:
        store.accepted([new])  # after the broker has it: no status for a send that was never published
    except StoreUnavailable as exc:  # published: its status follows from its outcomes as it is dispatched
        log.warning("the replay %s of %s is published, but its status was not recorded: %s", new.send_id, send_id, exc)
    return new
