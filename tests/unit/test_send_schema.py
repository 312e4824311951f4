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


def test_an_event_whose_lane_disagrees_with_its_category_is_a_lane_violation():
    """A producer that labels a marketing send `lane: transactional` does not get it into the
    transactional lane: the lane is derived from the category."""
    doc = orjson.loads(encode(build_send(validate_request(email_request("marketing")), "acme")))
    doc["lane"] = "transactional"
    with pytest.raises(MalformedEvent) as err:
        decode(orjson.dumps(doc))
    assert err.value.reason == "lane_violation"


@pytest.mark.parametrize("tenant", ["acme.eu", "acme:eu", "a" * 65, "", "acmé"])
def test_tenant_ids_a_provider_would_refuse_as_a_tag_are_rejected(tenant):
    with pytest.raises(SendValidationError, match="tenant_id: a tenant id holds 1 to 64 ASCII letters"):
        build_send(validate_request(email_request()), tenant)


@pytest.mark.parametrize("tags, message", [
    ([{"name": "campaign", "value": "spring sale"}], "String should match pattern"),
    ([{"name": "tenant", "value": "other"}], "the tag name 'tenant' is reserved"),
    ([{"name": "x" * 257, "value": "y"}], "String should match pattern"),
])
def test_tags_follow_the_providers_rules(tags, message):
    with pytest.raises(SendValidationError, match=message):
        validate_request(email_request(tags=tags))
    assert validate_request(email_request(tags=[{"name": "campaign", "value": "spring_sale-2"}]))


def test_an_invalid_address_is_not_repeated_in_the_error():
    """Errors reach logs and DLQ headers: they say which field, never the personal data itself."""
    with pytest.raises(SendValidationError) as err:
        validate_request(email_request(to=["jane.doe-at-example.test"]))
    assert "jane.doe" not in str(err.value) and "payload.to" in str(err.value)


def test_otp_templates_get_the_otp_policy_unless_the_send_names_one():
    assert build_send(validate_request({**email_request(), "template_id": "otp"}), "acme").policy == "otp"
    assert build_send(validate_request(email_request()), "acme").policy == "transactional"
    named = {**email_request(), "template_id": "otp", "policy": "transactional"}
    assert build_send(validate_request(named), "acme").policy == "transactional"
