"""The send: lane from category, field-level errors, frozen bytes, tolerant of unknown fields."""

import re
import uuid
from pathlib import Path
from typing import Annotated

import orjson
import pytest
from pydantic import Field, TypeAdapter, ValidationError

from streams.dispatch.intake import Rejected, admit
from streams.errors import SendValidationError
from streams.send import (
    EMAIL_PATTERN,
    MAX_SEND_BYTES,
    MalformedEvent,
    build_send,
    check_address,
    decode,
    encode,
    new_send_id,
    validate_batch,
    validate_request,
)
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


REFUSED_ADDRESSES = ["user@example.test\n", "Acme <no-reply@acme.test>\n",  # Python's `$` let these through
                     "Acme\r\nBcc: all@victim.test <no-reply@acme.test>",  # a header of its own at a provider
                     "Ac\x00me <no-reply@acme.test>", "us\x7fer@example.test", "us\x01er@example.test",
                     "Tab\tName <a@example.test>", "Line\u2028Break <a@example.test>", "Next\x85Line <a@example.test>"]
ACCEPTED_ADDRESSES = ["user@example.test", "Acme <no-reply@acme.test>", '"Doe, Jane" <jane@example.test>',
                      "Zoë <zoe@example.test>", "<bare@example.test>"]


@pytest.mark.parametrize("address", REFUSED_ADDRESSES)
def test_an_address_with_a_control_character_or_a_trailing_newline_is_refused_at_ingest_and_by_workers(address):
    """Given an address with a line break, NUL or another control character in it (a CR LF in a display
    name becomes a header of its own at a provider that writes it into one),
    When it is submitted as the sender or a recipient, or arrives in an event on a lane topic,
    Then ingest refuses it naming the field (422), and a worker's decode calls the event malformed."""
    for field in ("from", "to", "cc", "bcc", "reply_to"):  # every address field the provider is given
        with pytest.raises(SendValidationError, match=f"payload.{field}"):
            validate_request(email_request(**{field: address}))
    doc = orjson.loads(encode(build_send(validate_request(email_request()), "acme")))
    doc["payload"]["from"] = address
    with pytest.raises(MalformedEvent) as err:
        decode(orjson.dumps(doc))
    assert err.value.reason == "malformed"


def test_the_published_address_pattern_and_the_check_agree():
    """The OpenAPI publishes EMAIL_PATTERN; a JSON Schema validator (`$` only at the end, as in pydantic's
    own regex engine used here) must accept exactly the addresses the API accepts."""
    published = TypeAdapter(Annotated[str, Field(pattern=EMAIL_PATTERN)])
    for address in REFUSED_ADDRESSES + ACCEPTED_ADDRESSES + ["a@b", "a b@c.d", "x <a@b.c> y"]:
        try:
            published.validate_python(address)
            by_schema = True
        except ValidationError:
            by_schema = False
        try:
            check_address(address)
            by_check = True
        except ValueError:
            by_check = False
        assert by_schema == by_check, repr(address)
    for address in ACCEPTED_ADDRESSES:
        assert check_address(address) == address


def test_an_sms_number_takes_ascii_digits_only():
    """E.164 is ASCII digits; `\\d` in the pattern also let Arabic-Indic and other digits through."""
    with pytest.raises(SendValidationError, match="payload.to"):
        arabic_indic = "+1\u0664\u0661\u0665\u0665\u0665\u0665\u0660\u0661\u0662\u0663"
        validate_request({**sms_request(), "payload": {"to": arabic_indic, "body": "Your code is 123456"}})
    assert validate_request(sms_request())


@pytest.mark.parametrize("field", ["cc", "bcc", "reply_to"])
def test_copies_and_reply_addresses_are_held_to_the_recipient_limit(field):
    """`to` holds at most 50 recipients (Resend's rule); `cc`, `bcc` and `reply_to` went to the provider
    unchecked (5,000 blind copies were accepted). One address or a list of them, each checked."""
    assert validate_request(email_request(**{field: "copy@example.test"}))
    assert validate_request(email_request(**{field: ["a@example.test", "B <b@example.test>"]}))
    with pytest.raises(SendValidationError, match=f"payload.{field}"):
        validate_request(email_request(**{field: [f"u{i}@example.test" for i in range(51)]}))


def test_the_other_spelling_of_from_is_published_as_from():
    """`from_` is accepted for `from`; the provider reads `from` only, so the published payload carries
    `from` (before, the email went out with no sender and was refused at the provider)."""
    payload = {k: v for k, v in email_request()["payload"].items() if k != "from"}
    sent = build_send(validate_request({**email_request(), "payload": {**payload, "from_": "a@acme.test"}}), "acme")
    assert sent.payload["from"] == "a@acme.test" and "from_" not in sent.payload


def test_the_sdk_refuses_a_policy_the_workers_do_not_know_before_publishing(monkeypatch, tmp_path):
    """Given the SDK built as the README shows (`SendClient(bootstrap)`, no policies given),
    When a producer publishes a send naming a misspelt policy, and one naming a policy only the deployment's
    policy file (DUAL_RAIL_RETRY_POLICIES) has,
    Then the first is refused by name before anything is published (before: accepted, a send id returned, and the
    worker dead-lettered it `unknown_policy`), and the file's own policy is known."""
    import streams.retry.policy
    from streams.ingest.sdk import SendClient

    monkeypatch.delenv("DUAL_RAIL_RETRY_POLICIES", raising=False)
    client = SendClient("127.0.0.1:9")  # nothing listens there: a publish would fail, not pass
    try:
        with pytest.raises(SendValidationError, match="policy: unknown policy 'otp-fsat'"):
            client.publish("acme", {**email_request(), "policy": "otp-fsat"})
    finally:
        client.close()
    packaged = Path(streams.retry.policy.__file__).with_name("policies.toml").read_text()
    own = tmp_path / "policies.toml"
    own.write_text(packaged + '\n[policy.digest]\nmax_attempts = 2\nmax_age = "1h"\nschedule = ["10s"]\n')
    monkeypatch.setenv("DUAL_RAIL_RETRY_POLICIES", str(own))
    client = SendClient("127.0.0.1:9")
    client.close()
    assert "digest" in client.known_policies


@pytest.mark.parametrize("value, says", [
    (2**70, "an integer outside -2^63 .. 2^64-1"),
    ("\ud800", "unpaired surrogate"),
    (float("nan"), "NaN or an infinity"),
    (float("-inf"), "NaN or an infinity"),
])
def test_the_sdk_refuses_a_payload_value_the_events_cannot_carry_naming_where(value, says):
    """Given the SDK (nothing listens at its broker: a publish would fail, not pass),
    When a producer publishes a batch whose second send's payload holds, under a key that is an address, a value
    the events cannot carry (an integer past 64 bits, a lone surrogate, NaN or an infinity),
    Then the batch is refused with a SendValidationError naming send 1, the payload path (the address redacted) and
    why (before: a bare TypeError from the encoder, and NaN published as null without a word)."""
    from streams.ingest.sdk import SendClient

    client = SendClient("127.0.0.1:9")
    bad = {**email_request(), "payload": {**email_request()["payload"], "by_recipient": {"jane@example.test": value}}}
    try:
        with pytest.raises(SendValidationError, match=re.escape(says)) as refused:
            client.publish_batch("acme", [email_request(), bad])
    finally:
        client.close()
    [error] = refused.value.errors
    assert error["loc"][:3] == [1, "payload", "by_recipient"] and "jane@example.test" not in str(error["loc"])


def test_a_send_too_large_is_a_validation_error_not_a_publish_to_retry():
    """Given the SDK, When a producer publishes a send over the size limit, Then it is refused as invalid
    (SendValidationError, naming the send and the sizes), never as a PublishError a producer would retry."""
    from streams.errors import PublishError, SendTooLarge
    from streams.ingest.sdk import SendClient

    client = SendClient("127.0.0.1:9")
    big = {**email_request(), "payload": {**email_request()["payload"], "text": "x" * (MAX_SEND_BYTES + 1)}}
    try:
        with pytest.raises(SendTooLarge, match="send 0 is .* bytes; a send may be at most") as refused:
            client.publish("acme", big)
    finally:
        client.close()
    assert isinstance(refused.value, SendValidationError) and not isinstance(refused.value, PublishError)


@pytest.mark.parametrize("field, value, says", [
    ("attachments", [{"filename": "invoice.pdf", "content": "JVBERi0x"}], "does not send attachments"),
    ("scheduled_at", "2026-12-07T09:00:00Z", "does not schedule emails"),
])
def test_an_email_field_dispatch_would_not_send_is_refused_not_dropped(field, value, says):
    """Given an email carrying attachments, or a time to send it at (Resend's `POST /emails` takes both, its batch
    endpoint neither),
    When it is validated at ingest, and when a worker decodes such an event written to its lane directly,
    Then it is refused naming the field and why (before: accepted, the field dropped by the provider adapter, and
    the email delivered without its attachment, or at once, recorded `delivered`), and the worker's intake
    dead-letters the event as the send it is (its status then says so, not `accepted`); null or an empty value
    asks for nothing and is accepted, as before."""
    payload = {**email_request()["payload"], field: value}
    with pytest.raises(SendValidationError, match=says) as refused:
        validate_request({**email_request(), "payload": payload})
    assert refused.value.errors[0]["loc"] == ("payload", field)
    send = build_send(validate_request(email_request()), "acme")
    event = orjson.loads(encode(send))
    raw = orjson.dumps({**event, "payload": {**event["payload"], field: value}})
    with pytest.raises(MalformedEvent, match=f"{field}: .*{says}"):
        decode(raw)
    verdict = admit(raw, {}, "email", "transactional", frozenset({send.policy}))
    assert isinstance(verdict, Rejected) and verdict.reason == "malformed" and says in verdict.detail
    assert verdict.send is not None and verdict.send.send_id == send.send_id
    for empty in (None, "", [], {}):
        assert validate_request({**email_request(), "payload": {**email_request()["payload"], field: empty}})


@pytest.mark.parametrize("headers, where, says", [
    ({"Bcc": "everyone@example.test"}, ("Bcc", "[key]"), "recipients by `to`, `cc`, `bcc`"),
    ({"tO": "someone@example.test"}, ("tO", "[key]"), "not through `headers`"),
    ({"Content-Type": "text/plain"}, ("Content-Type", "[key]"), "set by dispatch"),
    ({"Resent-Reply-To": "everyone@example.test"}, ("Resent-Reply-To", "[key]"), "or by the provider"),
    ({"Disposition-Notification-To": "everyone@example.test"}, ("Disposition-Notification-To", "[key]"),
     "not through `headers`"),
    ({"X-Ref": "v" * 999}, ("X-Ref",), "at most 998 characters"),
    ({"X-Ref": "1\r\nBcc: everyone@example.test"}, ("X-Ref",), "a line break"),
    ({"X-Ref": "trailing\n"}, ("X-Ref",), "a line break"),
    ({"X-Ref": "null\x00byte"}, ("X-Ref",), "control character"),
    ({"X Ref": "1"}, ("X Ref", "[key]"), "not a header name"),
    ({"X-Ref:": "1"}, ("X-Ref:", "[key]"), "not a header name"),
    ({f"X-{i}": "1" for i in range(51)}, (), "at most 50"),
])
def test_custom_headers_cannot_add_recipients_or_lines(headers, where, says):
    """Given an email whose custom `headers` would set a recipient (`Bcc`, in any case), the MIME structure, or put a
    line break or a colon where a header has none (a second header, or a body, of the message the provider writes),
    When it is validated at ingest (the API, the SDK),
    Then it is refused naming the header and why, never repeating its value (before: passed through to the provider,
    a Bcc reaching recipients no address check or recipient cap saw); an event accepted before these rules, still on
    a lane or a retry tier at the upgrade, is decoded by workers (and replays) as it was accepted: sent, not
    dead-lettered unreplayable."""
    with pytest.raises(SendValidationError, match=says) as refused:
        validate_request(email_request(headers=headers))
    assert refused.value.errors[0]["loc"] == ("payload", "headers", *where)
    assert "everyone@example.test" not in str(refused.value)
    event = orjson.loads(encode(build_send(validate_request(email_request()), "acme")))
    accepted_earlier = decode(orjson.dumps({**event, "payload": {**event["payload"], "headers": headers}}))
    assert accepted_earlier.payload["headers"] == headers


def test_a_subject_is_one_line_and_ordinary_headers_pass_through():
    """A subject with a CR or LF (a header of its own in the message the provider writes) is refused at ingest
    naming `subject`; List-Unsubscribe and X- headers, the ones tenants use, are accepted and kept."""
    for subject in ("Hi\r\nBcc: everyone@example.test", "Hi\n", "\rHi", "Hi\u2028there", "Hi\x00"):
        with pytest.raises(SendValidationError, match="the subject has a line break or control character") as refused:
            validate_request(email_request(subject=subject))
        assert refused.value.errors[0]["loc"] == ("payload", "subject")
    headers = {"List-Unsubscribe": "<https://example.test/u/1>", "X-Entity-Ref-ID": "a:b\tc"}
    send = build_send(validate_request(email_request(headers=headers)), "acme")
    assert decode(encode(send)).payload["headers"] == headers
    event = orjson.loads(encode(send))  # accepted before the rule: decoded as it was accepted
    assert decode(orjson.dumps({**event, "payload": {**event["payload"], "subject": "Hi\n"}})).payload["subject"]


def test_the_published_subject_and_headers_schemas_and_the_checks_agree():
    """The OpenAPI publishes the subject's and the headers' rules as JSON Schema (which API clients and the API's
    fuzzing read): a JSON Schema validator accepts exactly the subjects and headers the API accepts."""
    import jsonschema_rs

    from streams.send import EmailPayload

    schema = EmailPayload.model_json_schema(by_alias=True)["properties"]
    subject, headers = (jsonschema_rs.validator_for(schema[name]) for name in ("subject", "headers"))

    def accepted(**payload) -> bool:
        try:
            validate_request(email_request(**payload))
            return True
        except SendValidationError:
            return False

    for value in ("Hi", "Hi\n", "a\tb", "x\u2028", "\x00", "Zoë", "\x85", "\r"):
        assert subject.is_valid(value) == accepted(subject=value), repr(value)
    for value in ({"X-A": "1"}, {"bcc": "x"}, {"BcC": "x"}, {"Resent-To": "x"}, {"rEsEnT-Date": "x"}, {"X-Resent": "x"}, {"X A": "1"}, {"X-A": "v\n"},
                  {"X-A\n": "v"}, {"": "v"}, {"List-Unsubscribe": "<a>"}, {"X-Ü": "v"}, {"X-A": "v" * 999}):
        assert headers.is_valid(value) == accepted(headers=value), repr(value)
