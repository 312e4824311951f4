"""A dead letter's replay: claimed once (whatever stops the call after the replay is published keeps the claim), and
allowed while the dead-letter topic keeps its payload."""

import time

import pytest

from streams.dispatch.idempotency import SendClaim
from streams.errors import ReplayOutcomeUnknown
from streams.retry import replay as replay_module
from streams.send import build_send, encode, validate_request
from tests.harness import sms_request


@pytest.fixture(autouse=True)
def no_claim_left(monkeypatch):
    """Dispatch holds no claim on the dead letter (processed_jobs, read in Redis, is not part of these tests)."""
    monkeypatch.setattr(replay_module, "read_send_claim", lambda client, keys, tenant, send_id: SendClaim(None))


class OneDeadLetter:
    """A status store holding one dead-lettered send, its replay claim kept as StatusStore keeps it."""

    client = keys = None

    def __init__(self, send):
        self.doc = {"status": "dead_lettered", "tenant_id": send.tenant_id, "accepted_at_ms": send.created_at_ms,
                    "reason": "retries_exhausted", "attempt_history": []}

    def get(self, send_id):
        return dict(self.doc)

    def claim_replay(self, send_id):
        if "replayed_as" in self.doc:
            return False
        self.doc["replayed_as"] = "pending"
        return True

    def release_replay(self, send_id):
        self.doc.pop("replayed_as", None)

    def mark_replayed(self, send_id, replay_id):
        self.doc["replayed_as"] = replay_id

    def accepted(self, sends):
        pass


class Client:
    """Publishes sends; its `accepted` events' publish is interrupted (an operator's Ctrl-C while it waits)."""

    def __init__(self):
        self.published = []
        self.interrupted = True
        self.publisher = self

    def publish_sends(self, sends):
        self.published.extend(sends)

    def accepted_records(self, sends):
        return [b"accepted"]

    def publish(self, records):
        if self.interrupted:
            self.interrupted = False
            raise KeyboardInterrupt


def test_ctrl_c_after_a_dead_letters_replay_is_published_keeps_it_claimed(monkeypatch):
    """Given a dead letter, and an operator who presses Ctrl-C while `streams dlq replay` waits for the replay's
    `accepted` event to be acknowledged (the replay itself is on the lane already),
    When the command ends, and the operator runs it again,
    Then the first run names the replay's send id as unconfirmed, and the second publishes nothing (before: the
    interruption freed the claim, and the second run published a second replay: delivered twice)."""
    send = build_send(validate_request(sms_request()), "acme")
    monkeypatch.setattr(replay_module, "_payload", lambda *args: encode(send))
    store, client = OneDeadLetter(send), Client()
    with pytest.raises(ReplayOutcomeUnknown) as interrupted:
        replay_module.replay_dead_letter("unused:9092", None, store, client, send.send_id)
    [replayed] = client.published
    assert interrupted.value.replay_id == replayed.send_id and store.doc["replayed_as"] == "pending"
    with pytest.raises(replay_module.ReplayRefused, match="left unconfirmed"):
        replay_module.replay_dead_letter("unused:9092", None, store, client, send.send_id)
    assert client.published == [replayed]


def test_a_dead_letter_is_replayable_while_the_dead_letter_topic_keeps_its_payload(monkeypatch):
    """Given a marketing send accepted 7.5 days ago and dead-lettered 5.5 days ago (too old: its 2-day max age), whose
    dead letter, kept 7 days from when it was written, still holds the payload,
    When an operator replays it,
    Then it is replayed (before: refused as "the payload has expired, nothing is left to send", counted from when
    the send was accepted)."""
    day_ms, now = 24 * 3600 * 1000, int(time.time() * 1000)
    send = build_send(validate_request(sms_request("marketing")), "acme", now_ms=now - int(7.5 * day_ms))
    monkeypatch.setattr(replay_module, "_payload", lambda *args: encode(send))  # found in the dead letter
    store, client = OneDeadLetter(send), Client()
    client.interrupted = False
    store.doc.update(completed_at_ms=now - int(5.5 * day_ms), reason="too_old")
    done = replay_module.replay_dead_letter("unused:9092", None, store, client, send.send_id, now_ms=now)
    assert done.send is not None and client.published == [done.send]


@pytest.mark.parametrize("status", ["dead_lettered", "skipped"])
@pytest.mark.parametrize("reason, last_outcome, refused", [
    ("unknown_outcome", "unknown", True), ("retry_copy_too_large", "unknown", True), ("too_large", "unknown", True),
    ("retries_exhausted", "unavailable", False), ("retry_copy_too_large", "unavailable", False),
])
def test_a_dead_letter_whose_last_attempt_went_unanswered_needs_the_outcome_checked(reason, last_outcome, refused,
                                                                                    status):
    """Given a send dead-lettered `reason` (or skipped: its endpoint disabled after it) after a last attempt whose
    outcome was `last_outcome` (a 5xx: unknown, the provider may hold it; a connection refused: unavailable),
    When it is replayed without --outcome-checked,
    Then one whose last attempt is unknown is refused until checked, whatever its reason (before: only the reason
    `unknown_outcome` was, and a send whose retry copy was too large for its tier after a 5xx was replayed at once
    under a new send id: delivered twice when the provider had taken the first)."""
    doc = {"status": status, "tenant_id": "t1", "reason": reason,
           "attempt_history": [{"n": 1, "outcome": "throttled"}, {"n": 2, "outcome": last_outcome}]}
    if refused:
        with pytest.raises(replay_module.ReplayNeedsCheck, match=f"{reason} after an attempt whose outcome is unknown"):
            replay_module._check(doc, "s-1", "t1", replay_module.REPLAYABLE, outcome_checked=False)
        assert replay_module._check(doc, "s-1", "t1", replay_module.REPLAYABLE, outcome_checked=True) == doc
    else:
        assert replay_module._check(doc, "s-1", "t1", replay_module.REPLAYABLE, outcome_checked=False) == doc


def test_a_delivered_send_whose_history_ends_unanswered_is_replayed_without_a_check():
    """Given a send delivered by a recovered request (which records no attempt: its history ends with the attempt
    whose answer was lost),
    When it is replayed as a send (`streams sends replay`),
    Then it is, without --outcome-checked: it was delivered, nothing about it is unknown."""
    doc = {"status": "delivered", "tenant_id": "t1", "reason": "", "attempt_history": [{"n": 1, "outcome": "unknown"}]}
    assert replay_module._check(doc, "s-1", "t1", replay_module.REPLAYABLE, outcome_checked=False) == doc
