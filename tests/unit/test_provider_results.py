"""Provider answers map to outcomes the retry policy understands; error bodies are redacted."""

import re
import subprocess
import sys

import httpx
import pytest

from streams.providers.outcome import Outbound, provider_excerpt, redact
from streams.providers.registry import load_registry
from streams.providers.resend import ResendEmail

RESEND = load_registry().providers["resend"]


def _provider(handler) -> ResendEmail:
    p = ResendEmail(RESEND, "http://provider.test")
    p.client._transport.inner = httpx.MockTransport(handler)  # unit test: no network, same allowlist
    return p


@pytest.mark.parametrize("status, name, outcome", [
    (200, "", "delivered"), (429, "rate_limit_exceeded", "throttled"), (429, "daily_quota_exceeded", "quota"),
    (429, "monthly_quota_exceeded", "quota"), (400, "validation_error", "rejected"),
    (422, "validation_error", "rejected"), (401, "invalid_api_key", "auth"),
    (403, "invalid_api_key", "auth"), (403, "validation_error", "rejected"), (403, "", "rejected"),
    (409, "invalid_idempotent_request", "unknown"), (409, "concurrent_idempotent_requests", "unknown"),
    (408, "", "unavailable"), (408, "request_timeout", "unavailable"),
    (500, "internal_server_error", "unknown"), (500, "application_error", "unknown"), (503, "", "unknown"),
    (502, "bad_gateway", "unknown"), (504, "", "unknown"), (507, "", "unknown"),
    (501, "", "unavailable"), (505, "", "unavailable"),
])
def test_status_and_error_name_decide_the_outcome(status, name, outcome):
    body = {"id": "m1"} if status == 200 else {"statusCode": status, "name": name, "message": "x"}
    result = _provider(lambda req: httpx.Response(status, json=body, headers={"retry-after": "3"})).post(
        "/emails", b"{}", "re_k", "k")
    assert result.outcome == outcome and result.status == status


@pytest.mark.parametrize("status, message, outcome", [
    (400, "API key is invalid", "auth"),  # Resend's answer to an Authorization header that is no key at all
    (400, "The `to` field must be a valid email address.", "rejected"),  # a field of the message
    (401, "API key is invalid", "auth"),
])
def test_a_key_resend_cannot_read_holds_the_provider_and_a_refused_field_rejects_the_message(status, message, outcome):
    """Given Resend answering `validation_error` with a message,
    When the adapter reads it,
    Then "API key is invalid" is an auth outcome whatever its status (400 for a mangled RESEND_API_KEYS entry: before,
    `rejected`, and every send was dead-lettered permanent_error with no auth alert), named `invalid_api_key`; any other
    400 validation_error is the message's rejection."""
    body = {"statusCode": status, "name": "validation_error", "message": message}
    result = _provider(lambda req: httpx.Response(status, json=body)).post("/emails", b"{}", "not-a-key", "k")
    assert result.outcome == outcome
    assert result.error_name == ("invalid_api_key" if outcome == "auth" else "validation_error")


def test_a_408_is_retried_not_dead_lettered():
    """A 408: the provider stopped waiting for the rest of the request, so it never acted on it. The send is
    retried on its policy's schedule (before, it was dead-lettered `permanent_error` at the first 408)."""
    from streams.retry.policy import RetryAt, decide, load_policies

    result = _provider(lambda req: httpx.Response(408, text="Request Timeout")).post("/emails", b"{}", "re_k", "k")
    decision = decide(load_policies()["transactional"], 1, 0, result, 1_000, 0.5)
    assert result.outcome == "unavailable" and isinstance(decision, RetryAt)
    assert decision.reason == "provider_unavailable"


def test_lost_answer_is_unknown_and_refused_connection_is_unavailable():
    def read_timeout(req):
        raise httpx.ReadTimeout("late", request=req)

    def refused(req):
        raise httpx.ConnectError("refused", request=req)

    lost, never = (_provider(answer).post("/emails", b"{}", "re_k", "k") for answer in (read_timeout, refused))
    assert (lost.outcome, lost.never_sent) == ("unknown", False)
    assert (never.outcome, never.never_sent) == ("unavailable", True)  # its gate tokens are given back


def test_batch_body_is_deterministic_and_carries_the_routing_tags():
    p = ResendEmail(RESEND, "http://provider.test")
    msgs = [Outbound(f"id-{i}", "acme", "marketing", {"from": "a@b.co", "to": ["c@d.co"], "subject": "s",
                                                       "text": "t", "internal": "not sent"}) for i in (2, 1)]
    path, body = p.build(msgs, batch=True)
    assert path == "/emails/batch"
    assert body == p.build(list(reversed(msgs)), batch=True)[1]
    assert b'"internal"' not in body and b'{"name":"send_id","value":"id-1"}' in body
    with pytest.raises(ValueError, match="1..100"):
        p.build(msgs * 51, batch=True)


def test_null_tags_mean_none_and_a_webhook_event_may_spell_occurred_at_either_way():
    """Ingest accepts `"tags": null` and `occurred_at` (the field's own name) besides `occurredAt`; the
    request built from such a payload has no tags of its own, and the same delivery body."""
    from streams.webhooks.delivery import delivery_body

    email = Outbound("id-1", "acme", "marketing", {"from": "a@b.co", "to": ["c@d.co"], "subject": "s", "text": "t",
                                                   "tags": None})
    assert [t["name"] for t in email.tags()] == ["send_id", "tenant", "lane"]
    event = {"event_id": "e1", "event_type": "invoice.paid", "data": {"n": 1}}
    assert delivery_body({**event, "occurred_at": "2026-12-01T10:00:00Z"}) == \
        delivery_body({**event, "occurredAt": "2026-12-01T10:00:00Z"})


def test_redaction_removes_addresses_numbers_and_keys():
    text = redact('{"message": "bad to: jane.doe@example.com, +1 415 555 0123, key re_AbC123"}')
    assert "jane" not in text and "555" not in text and "AbC123" not in text


@pytest.mark.parametrize("text, secret", [
    ("API key sk_live_9f8e7d6c5b4a39281706f5e4 is not valid", "9f8e7d6c5b4a"),
    ("key pk_test_51HxYzAbCdEfGh refused, rk_live_abcdefghijklmnopqrstu too", "51HxYzAbCdEfGh"),
    ("key_9f8e7d6c5b4a3928 unknown", "9f8e7d6c5b4a3928"),
    ("rejected: Authorization: Bearer 0a1b2c3d4e5f.g6h7", "0a1b2c3d4e5f"),
    ("token eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJjbGllbnQtMSJ9.c2lnbmF0dXJl expired", "eyJzdWIiOiJjbGllbnQtMSJ9"),
    ("bad recipient to=anna%40example.com&cc=bo%2Bnews%40example.co.uk", "anna"),
    ("bad recipient to=anna%40example.com&cc=bo%2Bnews%40example.co.uk", "news"),
    # ours, echoed by a receiver or a proxy: a tenant's API key, an operator's, a webhook signing secret
    ("unauthorised: dr_ten_Q2x-9vZ_a1B2c3D4e5F6g7H8i9J0kLmN", "Q2x-9vZ_a1B2c3D4e5F6g7H8"),
    ("echo {'key': 'dr_ope_abcdEFGHijklMNOPqrstUVWX'}", "abcdEFGHijklMNOPqrstUVWX"),
    ("secret whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw+/x= rejected", "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"),
])
def test_redaction_removes_tokens_key_shapes_and_percent_encoded_addresses(text, secret):
    assert secret not in redact(text), redact(text)


def test_redaction_of_a_long_echo_reads_only_what_the_excerpt_keeps():
    """A provider (or a proxy) echoing a 210 KB percent-encoded request: the patterns, some quadratic on long
    unbroken runs and holding the GIL, took minutes over it, and every thread of the worker (its poll loop, its
    lease refreshes) waited. A secret cut short by the excerpt's end is left out, not shown in part."""
    # In a process of its own: a regular expression holds the GIL, so no thread of this one could time it.
    code = 'from streams.providers.outcome import redact; redact("%7B%22to%22%3A" * 15_000)'
    subprocess.run([sys.executable, "-c", code], check=True, timeout=10)  # minutes before
    # An address that shrinks to ***@*** brings what follows into the excerpt, a key the cut went through too.
    cut_key = "a" * 980 + "@example.com " + "sk_live_1234567890abcdef and more"
    assert "sk_live" not in redact(cut_key, limit=500)
    # Compact JSON longer than the cut (no space in it) keeps its excerpt.
    compact = '{"message":"bad","echo":"' + "a" * 1200 + '"}'
    assert redact(compact, limit=500).startswith('{"message":"bad"')


def test_redaction_keeps_error_names_that_only_look_like_keys():
    assert redact("key_not_found: the domain is not verified") == "key_not_found: the domain is not verified"


@pytest.mark.parametrize("status", [401, 422])
def test_the_key_a_request_carried_is_stripped_from_the_providers_answer_whatever_its_shape(status):
    """A provider that echoes the credential it refused (here a key of no known shape) never gets it into
    the excerpt that is logged and put in DLQ headers."""
    key = "Zq8v-31kf.LmN0pQ"
    body = {"statusCode": status, "name": "invalid_api_key", "message": f"API key {key} is not valid"}
    result = _provider(lambda req: httpx.Response(status, json=body)).post("/emails", b"{}", key, "k")
    assert key not in result.error_body and "is not valid" in result.error_body


def test_every_non_2xx_carries_its_status_and_a_redacted_body():
    body = {"statusCode": 422, "name": "validation_error", "message": "Invalid `to`: jane@example.com"}
    result = _provider(lambda req: httpx.Response(422, json=body)).post("/emails", b"{}", "re_k", "k")
    assert result.status == 422 and result.error_name == "validation_error"
    assert "Invalid" in result.error_body and "jane@example.com" not in result.error_body


def test_a_2xx_whose_body_cannot_be_read_is_an_unknown_outcome():
    """The provider probably accepted it, but we cannot tell which messages: ask again with the same key."""
    result = _provider(lambda req: httpx.Response(200, content=b"<html>ok</html>")).post("/emails", b"{}", "re_k", "k")
    assert result.outcome == "unknown" and result.error_name == "unreadable_body"


def test_a_connection_reset_after_sending_is_an_unknown_outcome():
    def reset(req):
        raise httpx.ReadError("connection reset by peer", request=req)

    assert _provider(reset).post("/emails", b"{}", "re_k", "k").outcome == "unknown"


@pytest.mark.parametrize("name, passed_on", [
    ("rate_limit_exceeded", "rate_limit_exceeded"), ("RATE_LIMITED", "RATE_LIMITED"), ("21211", "21211"),
    ("too many sends to jane@example.com or +15551234567", "other"), ("x" * 300, "other"), ("", "")])
def test_a_providers_error_name_is_passed_on_only_as_a_short_code(name, passed_on):
    """Given a 429 whose error `name` is a code, or free text quoting a recipient, or 300 characters long,
    When the adapter reads it,
    Then a code is passed on as it is (logs, dead-letter headers, the attempt history, the 429 metric's label), and
    anything else as `other` (before: as it came, so a recipient's address reached our logs and a label took any
    value the provider wrote)."""
    result = _provider(lambda req: httpx.Response(429, json={"name": name, "message": "x"})).post(
        "/emails", b"{}", "re_k", "k")
    assert (result.outcome, result.error_name) == ("throttled", passed_on)


@pytest.mark.parametrize("body, outcome, name", [
    ({"id": None}, "rejected", "no_message_id"),
    ({"data": [{"id": None}, {"id": None}]}, "rejected", "no_message_id"),
    ({"data": [{"id": "m1"}, {"id": None}]}, "unknown", "message_id_missing")])
def test_a_2xx_naming_a_null_message_id_is_not_a_delivery(body, outcome, name):
    """A 2xx whose id is null names no message: it is `no_message_id`, as a missing id is (before: delivered, with
    the provider message id "None"). A batch answered with some ids and some nulls was taken in part: its outcome
    is unknown, never a rejection (before: rejected, so its sends were dead-lettered `permanent_error`, which a
    replay sends again without a check: the named ones twice)."""
    result = _provider(lambda req: httpx.Response(200, json=body)).post("/emails", b"{}", "re_k", "k")
    assert (result.outcome, result.error_name) == (outcome, name)


@pytest.mark.parametrize("body, kept, gone", [
    ('Invalid to: John Smith <john@example.com>; subject "Your login code is 483920"',
     ["Invalid to:", "subject"], ["John", "Smith", "login code", "483920"]),
    ('Authorization: Token abcdefghijklmnop12345; password=hunter2xyz; api_key=AKIAIOSFODNN7EXAMPLE',
     ["Authorization"], ["abcdefghijklmnop", "hunter2", "AKIAIOSFODNN7"]),
    ('access_token=ya29.A0AfH6SMBxyz; refresh_token=1//0gabc; client_secret=cs_live_verysecret',
     ["access_token", "refresh_token", "client_secret"], ["ya29", "0gabc", "verysecret"]),
    ('{"statusCode": 422, "name": "validation_error", "message": "Invalid `to` field: it must be an email address"}',
     ["validation_error", "Invalid `to` field"], []),
    ('{"error": {"code": "invalid_recipient", "message": "Recipient \\"Jane Roe\\" <jane@example.com> is invalid"}}',
     ["invalid_recipient", "Recipient", "is invalid"], ["Jane", "Roe", "jane"]),
    ('\n {"message": "Recipient \\"Jane Roe\\" <jane@example.com>"}', ["Recipient"], ["Jane", "Roe"]),
    (' {"api_key": "AKIAIOSFODNN7EXAMPLE", "password": "hunter2xyz"}', ["api_key", "password"],
     ["AKIAIOSFODNN7", "hunter2"]),
    ('{"message": "bad", "echo": {"to": "Jane Roe", "text": "Order 77812 ships today"}}', ["bad"], ["Jane", "Order"]),
    ('{"errors": [{"message": "Sender not verified"}]}', ["Sender not verified"], []),
    ("The recipient's name 'Jane Roe' is not allowed", ["recipient's name", "is not allowed"], ["Jane", "Roe"]),
    ("Can't send subject 'Your code is 48' to them", ["Can't send subject", "to them"], ["Your code"]),
    ('Error: ' + 'x' * 440 + ' subject "Your login code for Jane Roe is ready, ' + 'y' * 2000 + '"', ["subject"],
     ["Jane", "login code"]),
    ("Mailbox unavailable.\nThe message to Jane Roe <jane@example.com> was rejected",
     ["Mailbox unavailable.", "The message to", "was rejected"], ["Jane", "Roe", "jane"]),
    ("[ERROR] 421 Service temporarily unavailable", ["[ERROR] 421 Service temporarily unavailable"], []),
    ("<html><body>502 Bad Gateway</body></html>", ["502 Bad Gateway"], []),
    ("Daily quota exceeded; request req_12345, order 77812", ["Daily quota exceeded", "req_12345"], ["77812"]),
    ('{"message": "unterminated text about Jane', ['{"message": "'], ["unterminated", "Jane"]),
])
def test_a_providers_error_answer_keeps_its_error_not_what_it_echoes_of_the_request(body, kept, gone):
    """Given email/SMS provider error answers echoing a recipient's name, a quoted subject with a code, credentials
    written as name=value, or a whole request,
    When the adapter keeps their excerpt (for the worker's log line and the retry and dead-letter headers),
    Then the error's name and message stay, and none of what they echo does (before, only addresses, phone numbers
    and key shapes were taken out: a name, a subject, a code or `password=...` reached the log and the DLQ)."""
    excerpt = provider_excerpt(body)
    for text in kept:
        assert text in excerpt, excerpt
    for text in gone:
        assert text not in excerpt, excerpt


def test_the_adapter_keeps_a_providers_error_without_the_recipient_it_echoes():
    """Given a provider answering 422 with the recipient's name and the message's subject in its error,
    When the adapter reads the answer,
    Then its excerpt (logged, and put in retry and dead-letter headers) keeps the error, not the name or subject."""
    body = {"statusCode": 422, "name": "validation_error",
            "message": 'Invalid `to`: Jane Roe <jane@example.com> for "Your code is 483920"'}
    result = _provider(lambda req: httpx.Response(422, json=body)).post("/emails", b"{}", "re_k", "k")
    assert "Invalid `to`" in result.error_body
    assert not re.search(r"Jane|Roe|483920|Your code", result.error_body), result.error_body
