"""Which outcome events the status store can record: the checks the outcome recorder and `streams state
recover` share (pure code)."""

import pytest

from streams.outcomes import STATUSES, accepted_events, events_of, unusable
from streams.send import build_send, validate_request
from tests.harness import email_request


def _event(**fields) -> dict:
    return {"send_id": "s-1", "tenant_id": "acme", "status": "delivered", "attempts": 1, "provider": "resend",
            "completed_at_ms": 1, "origin": {"topic": "t", "partition": 0, "offset": 5}, **fields}


def test_events_our_writers_produce_are_usable():
    assert unusable(_event()) is None
    sends = [build_send(validate_request(email_request()), "acme")]
    assert [unusable(e) for e in accepted_events(sends, 1)] == [None]
    assert unusable(_event(attempts=None, providers_tried=["resend", "sms_b"], dlq={"partition": 0, "offset": 1},
                           attempt={"n": 1}, endpoint_id="ep_1", replay_of=None)) is None
    assert [unusable(_event(status=status)) for status in STATUSES] == [None] * 7


@pytest.mark.parametrize("fields, named", [
    ({"send_id": ""}, "'send_id'"), ({"tenant_id": None}, "'tenant_id'"), ({"status": 5}, "'status'"),
    ({"provider": ["resend"]}, "'provider'"), ({"completed_at_ms": "x"}, "'completed_at_ms'"),
    ({"attempts": True}, "'attempts'"), ({"origin": {"offset": {}}}, "'origin'"), ({"dlq": [1]}, "'dlq'"),
    ({"origin": {"topic": "t", "partition": "0", "offset": 5}}, "'origin'"), ({"origin": {"topic": 5}}, "'origin'"),
    ({"providers_tried": "resend"}, "'providers_tried'"), ({"attempt": 3}, "'attempt'"),
    ({"attempt": {"n": "1"}}, "'attempt'"),
    # A status no writer writes (another producer's, a newer version's) would be a metric label and a status of its
    # own, over the send's real one; a place without the fields its readers take together names no record.
    ({"status": "Delivered"}, "'status' is not one of accepted, retrying"), ({"status": "sent"}, "'status'"),
    ({"origin": {"partition": 0, "offset": 5}}, "'origin' is not an object of topic and partition and offset"),
    ({"dlq": {"offset": 3}}, "'dlq' is not an object of partition and offset"),
    ({"endpoint_id": ["e"]}, "'endpoint_id'"), ({"lane": {"x": 1}}, "'lane'"), ({"accepted_at_ms": 1.5}, "'accepted_at_ms'"),
])
def test_an_event_with_a_field_of_the_wrong_type_is_unusable_and_the_field_named(fields, named):
    assert named in unusable(_event(**fields))


def test_a_record_holds_one_event_or_several():
    assert events_of(_event()) == [_event()]
    assert events_of({"events": [_event(), 5, _event(send_id="s-2")]}) == [_event(), _event(send_id="s-2")]
    assert events_of([1, 2]) == [] and events_of(None) == []
