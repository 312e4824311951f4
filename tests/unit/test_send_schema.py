"""The send: lane from category, field-level errors, frozen bytes, tolerant of unknown fields."""

import uuid

import orjson
import pytest

from streams.errors import SendValidationError
from streams.send import MalformedEvent, build_send, decode, encode, new_send_id, validate_batch, validate_request
from tests.harness import email_request, sms_request


@pytest.mark.parametrize("category, lane", [("transactional", "transactional"), ("product", "transactional"),
                                            ("marketing", "marketing")])
def test_category_decides_the_lane(category, lane):
    assert build_send(validate_request(email_request(category)), "acme").lane == lane


def test_send_ids_are_uuidv7_and_sort_by_creation():
    ids = [new_send_id(now_ms=t) for t in (1_000, 2_000, 3_000)]
    assert ids == sorted(ids) and all(uuid.UUID(i).version == 7 for i in ids)


def test_invalid_batch_reports_every_error_with_its_index():
    with pytest.raises(SendValidationError) as err:
        validate_batch([email_request(), email_request(subject=""), {**sms_request(), "payload": {"to": "555"}},
                        "nope"])
    locs = [e["loc"] for e in err.value.errors]
    assert (1, "payload", "subject") in locs
    assert (2, "payload", "to") in locs and (2, "payload", "body") in locs
    assert (3,) in locs


def test_unknown_policy_is_rejected_by_name():
    with pytest.raises(SendValidationError, match="policy: unknown policy 'vip'"):
        validate_request({**email_request(), "policy": "vip"}, frozenset({"otp"}))


def test_encoded_send_round_trips_and_unknown_fields_are_tolerated():
    send = build_send(validate_request({**email_request(), "future_field": 1}), "acme")
    raw = encode(send)
    doc = orjson.loads(raw)
    doc["added_by_a_newer_producer"] = True
    assert decode(orjson.dumps(doc)) == send
    assert decode(raw).payload == email_request()["payload"]


@pytest.mark.parametrize("value, reason", [
    (b"", "malformed"), (b"[1]", "malformed"), (b"{bad", "malformed"),
    (b'{"v": 9}', "unknown_version"), (b'{"v": 1, "send_id": "x"}', "malformed"),
])
def test_undecodable_events_say_why(value, reason):
    with pytest.raises(MalformedEvent) as err:
        decode(value)
    assert err.value.reason == reason
