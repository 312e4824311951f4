"""Replaying a send: a new delivery, not a retry (`streams sends replay <id>`, `streams dlq replay <id>`).

A retry keeps the send id, so receivers and the provider deduplicate it; a replay is deliberate and
must not be deduplicated away: it gets a completely new send id (and so a new provider idempotency
key), a new creation time (its age starts now), and carries the original id in `replay_of`. The
payload is byte-identical, read from where the send was kept: its dead letter, or, for a send that
was delivered, the lane message that was delivered. Payloads are kept 7 days; after that a replay
fails with an error that says so (the history is kept 30 days, so the error can say when).
A send dead-lettered `unknown_outcome` is replayed only once the caller says it checked the provider
does not hold it; a dead letter replayed as such (`replay_dead_letter`) is replayed once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from ..dispatch.idempotency import read_send_claim
from ..errors import (
    MalformedEvent,
    PublishError,
    PublishOutcomeUnknown,
    ReplayNeedsCheck,
    ReplayNotYet,
    ReplayOutcomeUnknown,
    ReplayRefused,
    SendTooLarge,
    StoreUnavailable,
)
from ..ingest.publisher import RecordTooLarge
from ..ingest.sdk import SendClient
from ..ingest.status import REPLAY_PENDING as PENDING
from ..ingest.status import StatusStore
from ..names import TopicNames
from ..send import Send, decode, new_send_id
from .dlq import PAYLOAD_DAYS, fetch, find

log = logging.getLogger("streams.replay")
PAYLOAD_MS = PAYLOAD_DAYS * 24 * 3600 * 1000
REPLAYABLE = frozenset({"delivered", "dead_lettered", "dropped", "skipped"})
DEAD_LETTERED = frozenset({"dead_lettered", "dropped"})  # a webhook delivery's dead letter is `dropped`
# How an operator says they checked that the provider does not hold a send left to reconciliation.
OUTCOME_CHECKED = "`--outcome-checked` (CLI) or `?outcome_checked=true` (API)"


def _when(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M UTC")


def _started(status: dict) -> int:
    return int(status.get("accepted_at_ms") or status.get("completed_at_ms") or 0)


def _kept_since(status: dict) -> int:
    """When the newest copy of the send's payload was written: a dead letter's when it was dead-lettered (the DLQ
    keeps it PAYLOAD_DAYS from then, days after the send was accepted), else when it was accepted (its lane's)."""
    if status.get("status") in DEAD_LETTERED and status.get("completed_at_ms"):
        return int(status["completed_at_ms"])
    return _started(status)


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


def _status(store: StatusStore, send_id: str) -> dict | None:
    """The send's status. None only while Redis holds its data: after a loss, before `streams state recover` has
    rebuilt the statuses, StateLost (a dead letter's status may be among those lost; "no send" would say it never
    existed)."""
    status = store.get(send_id)
    if status is None:
        store.require_data()
    return status


def _check(status: dict | None, send_id: str, tenant: str | None, statuses: frozenset[str],
           outcome_checked: bool) -> dict:
    """The send's status when it may be replayed; else ReplayRefused saying why."""
    if status is None or (tenant is not None and status.get("tenant_id") != tenant):
        raise ReplayRefused(f"no send {send_id} (its history is kept 30 days)")
    if status["status"] == "delivered" and "delivered" not in statuses:
        raise ReplayRefused(f"send {send_id} was delivered: it is not a dead letter (a new delivery of it is "
                            f"`streams sends replay {send_id}`)")
    if status["status"] not in statuses:
        allowed = " or ".join(sorted(statuses))
        raise ReplayRefused(f"send {send_id} is {status['status']}: only a send that is {allowed} can be replayed "
                            "here (one still in progress is retried by dispatch itself)")
    # Its last attempt unanswered, a send given up for another reason (its retry copy too large for the tier), or
    # skipped after it, may be held by the provider as well as one dead-lettered unknown_outcome. (A delivered
    # one's history may end unanswered too: a recovered request settled it, and records no attempt of its own.)
    last_attempt = (status.get("attempt_history") or [{}])[-1]
    unanswered = status["status"] != "delivered" and last_attempt.get("outcome") == "unknown"
    if (status.get("reason") == "unknown_outcome" or unanswered) and not outcome_checked:
        raise ReplayNeedsCheck(f"send {send_id} was dead-lettered {status.get('reason')} after an attempt whose "
                               "outcome is unknown: the provider may have accepted it, and a replay (a new send id) "
                               "would deliver it a second time; check with the provider that it does not hold it, "
                               f"then replay with {OUTCOME_CHECKED}")
    return status


def _check_dispatch_is_done(store: StatusStore, status: dict, send_id: str) -> None:
    """Refused while dispatch may yet deliver the send itself, or once it has and its status is behind: a request
    of several sends kept to be re-sent byte for byte under its key (its outcome unknown) carries it, and is re-sent
    whole when a copy of another of its sends comes (a replay beside it could be delivered twice, the operator's
    check with the provider notwithstanding); not once every other send is settled (none has a copy left to come)."""
    claim = read_send_claim(store.client, store.keys, status["tenant_id"], send_id)
    if claim.state == "delivered":
        raise ReplayRefused(f"send {send_id} has been delivered since it was {status['status']}: a request carrying "
                            "it was sent again under its key (its status follows shortly); it is not replayed")
    if claim.in_flight:
        raise ReplayNotYet(f"send {send_id} is being sent again by dispatch right now (a request carrying it, whose "
                           "outcome was unknown, is in flight under its key): a replay now could be delivered beside "
                           "it; ask again in a minute")
    if claim.others and (unsettled := store.unsettled(claim.others)):
        named = ", ".join(unsettled[:3]) + (f" and {len(unsettled) - 3} more" if len(unsettled) > 3 else "")
        raise ReplayNotYet(f"send {send_id} is carried by a batch request whose outcome is unknown, to be sent again "
                           f"whole under its key when one of its unsettled sends ({named}) is retried: a replay now "
                           "could be delivered beside it; replay once those are settled (the request is kept "
                           f"{claim.kept_s // 3600 + 1} h more at most)")


# Runs just before a replay is published: raises to refuse it; returns what gives back what it charged, if anything.
Admit = Callable[[Send], Callable[[], None] | None]


def replay(bootstrap: str, names: TopicNames, store: StatusStore, client: SendClient, send_id: str,
           tenant: str | None = None, now_ms: int | None = None, statuses: frozenset[str] = REPLAYABLE,
           outcome_checked: bool = False, admit: Admit | None = None, alone: bool = False) -> Send:
    """Publish a new send with the payload of `send_id` (one of `statuses`); returns it. `tenant`, when
    given, must own the send (a tenant never sees another tenant's sends). A send dead-lettered
    `unknown_outcome` is refused unless `outcome_checked` (the caller checked the provider does not hold it).
    `admit(new)`, when given, runs just before the publish (a tenant's ingest quotas: it raises to refuse the
    replay, nothing published) and returns what gives its charge back should the broker refuse it (None: nothing
    to give back). `alone`: a replay asked for by itself, which claims nothing (`streams sends replay`, a tenant's
    replay of one delivery): the send is then marked replayed as the new one, so that a dead-letter or bulk replay
    asked later answers with it rather than deliver it again; when the broker left it unconfirmed, marked as a claim
    left pending (bulk replays pass it over, a dead-letter replay is refused as unconfirmed, and the replay's own
    events, should it be out, name it there)."""
    now_ms = now_ms or int(time.time() * 1000)
    status = _check(_status(store, send_id), send_id, tenant, statuses, outcome_checked)
    if status["status"] != "delivered":  # a delivered one's replay is asked for as a new delivery
        _check_dispatch_is_done(store, status, send_id)
    if now_ms - _kept_since(status) > PAYLOAD_MS:
        raise ReplayRefused(f"the payload of send {send_id} has expired: payloads are kept {PAYLOAD_DAYS} days "
                            f"(sent {_when(_started(status))}); nothing is left to send")
    try:
        original = decode(_payload(bootstrap, names, send_id, status))
    except MalformedEvent as exc:
        raise ReplayRefused(f"send {send_id} cannot be replayed: its event is not a valid send "
                            f"({exc.reason}: {exc.detail})") from None
    if original.send_id != send_id or original.tenant_id != status.get("tenant_id"):
        # The record at the position its status names is another send's (a topic deleted and created again
        # reuses offsets): sending it would deliver someone else's message, perhaps another tenant's.
        raise ReplayRefused(f"send {send_id} cannot be replayed: the record where its payload was kept is now "
                            "another send's (was the topic recreated?); nothing is sent")
    new = original.model_copy(update={"send_id": new_send_id(now_ms), "created_at_ms": now_ms, "replay_of": send_id})
    give_back = admit(new) if admit is not None else None
    try:
        client.publish_sends([new])
    except (RecordTooLarge, SendTooLarge) as exc:  # for good: too large for the topic, or grown by replay_of
        if give_back is not None:
            give_back()
        raise ReplayRefused(f"send {send_id} cannot be replayed: {exc}") from None
    except PublishOutcomeUnknown as exc:  # a second replay would be another send id: not deduplicated
        if alone:
            _mark_replayed_alone(store, send_id, PENDING, status["tenant_id"])
        raise ReplayOutcomeUnknown(f"the replay of {send_id} may have been published as {new.send_id} ({exc}); "
                                   f"look it up (`streams sends show {new.send_id}`) before replaying again",
                                   new.send_id) from None
    except PublishError as exc:
        if give_back is not None:  # nothing published: nothing charged
            give_back()
        raise PublishError(f"the replay of {send_id} was not published: {exc}") from None
    except (Exception, KeyboardInterrupt) as exc:  # an operator's Ctrl-C, or anything else, while the broker
        # may be writing it: as unconfirmed (a caller freeing its replay claim now could replay it twice)
        if alone:
            _mark_replayed_alone(store, send_id, PENDING, status["tenant_id"])
        raise ReplayOutcomeUnknown(f"the replay of {send_id} may have been published as {new.send_id} (interrupted: "
                                   f"{type(exc).__name__}); look it up (`streams sends show {new.send_id}`) before "
                                   "replaying again", new.send_id) from exc
    try:
        if alone:
            _mark_replayed_alone(store, send_id, new.send_id, status["tenant_id"])
        _record_published(store, client, new)
    except KeyboardInterrupt as exc:  # published: as unconfirmed, so that a caller keeps its replay claim
        raise ReplayOutcomeUnknown(f"the replay of {send_id} is published as {new.send_id} (interrupted while it was "
                                   f"recorded); look it up (`streams sends show {new.send_id}`) before replaying "
                                   "again", new.send_id) from exc
    return new


def _mark_replayed_alone(store: StatusStore, send_id: str, replay_id: str, tenant: str) -> None:
    try:
        store.mark_replayed_alone(send_id, replay_id, tenant)
    except StoreUnavailable as exc:  # the answer names the replay all the same
        log.warning("the replay %s of %s is not recorded as its replay: %s", replay_id, send_id, exc)


def _record_published(store: StatusStore, client: SendClient, new: Send) -> None:
    """A published replay's `accepted` event and status; what fails is logged (the replay is out: the answer
    names it, and a caller must not free its claim)."""
    try:
        # Its `accepted` event: the durable record that `replay_of` was replayed, from which `streams state recover`
        # rebuilds the mark that stops a second replay after a Redis data loss (so are the replay's later outcomes).
        client.publisher.publish(client.accepted_records([new]))
    except Exception as exc:  # noqa: BLE001
        log.warning("the replay %s of %s is published, but its accepted event was not: %s", new.send_id,
                    new.replay_of, exc)
    try:
        store.accepted([new])  # after the broker has it: no status for a send that was never published
    except Exception as exc:  # noqa: BLE001 - its status follows from its outcomes as it is dispatched
        log.warning("the replay %s of %s is published, but its status was not recorded: %s", new.send_id,
                    new.replay_of, exc)


@dataclass(frozen=True)
class DeadLetterReplay:
    send_id: str            # the replay's send id
    send: Send | None       # None: an earlier call replayed it, and nothing was published now


def replay_dead_letter(bootstrap: str, names: TopicNames, store: StatusStore, client: SendClient, send_id: str,
                       outcome_checked: bool = False, now_ms: int | None = None,
                       admit: Admit | None = None) -> DeadLetterReplay:
    """Replay a dead letter once (`streams dlq replay`, POST /v1/admin/dlq/{id}/replay): it is claimed as a
    bulk webhook replay claims it (StatusStore.claim_replay), so a second call, by another operator or a
    client retrying after a timeout, is answered with the first replay's send id and publishes nothing.
    A refusal, or a publish with nothing published, frees the claim; a publish the broker left unconfirmed
    keeps it (that replay may exist: `streams sends replay` sends it again deliberately). `admit`: as for `replay`."""
    status = _status(store, send_id)
    if earlier := _replayed_as(status):
        return DeadLetterReplay(earlier, None)
    _check(status, send_id, None, DEAD_LETTERED, outcome_checked)  # refused before anything is claimed
    if not store.claim_replay(send_id):
        if earlier := _replayed_as(store.get(send_id)):
            return DeadLetterReplay(earlier, None)
        raise ReplayRefused(f"send {send_id} is being replayed by another call, or its replay was left unconfirmed "
                            "by the broker (that call named the send id to look up); a new delivery regardless is "
                            f"`streams sends replay {send_id}`")
    try:
        new = replay(bootstrap, names, store, client, send_id, now_ms=now_ms, statuses=DEAD_LETTERED,
                     outcome_checked=outcome_checked, admit=admit)
    except PublishOutcomeUnknown:
        raise
    except BaseException:
        try:
            store.release_replay(send_id)
        except StoreUnavailable as exc:  # the failure itself is the answer; the claim stays (never twice)
            log.warning("the replay claim of %s was not freed: %s", send_id, exc)
        raise
    try:
        store.mark_replayed(send_id, new.send_id)
    except StoreUnavailable as exc:  # published: the answer names it; the claim stays (never replayed twice)
        log.warning("the replay %s of %s is published, but not recorded as its replay: %s", new.send_id, send_id, exc)
    return DeadLetterReplay(new.send_id, new)


def _replayed_as(status: dict | None) -> str | None:
    """The send id of the send's replay, once one is published (a claim still pending is none)."""
    earlier = (status or {}).get("replayed_as")
    return earlier if earlier and earlier != PENDING else None
