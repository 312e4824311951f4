"""Provider answers map to outcomes the retry policy understands; error bodies are redacted."""

import httpx
import pytest

from streams.providers.outcome import Outbound, redact
from streams.providers.resend import ResendEmail


def _provider(handler) -> ResendEmail:
    p = ResendEmail("http://provider.test")
    p.client._transport.inner = httpx.MockTransport(handler)  # unit test: no network, same allowlist
    return p


@pytest.mark.parametrize("status, name, outcome", [
    (200, "", "delivered"), (429, "rate_limit_exceeded", "throttled"), (429, "daily_quota_exceeded", "quota"),
    (429, "monthly_quota_exceeded", "quota"), (400, "validation_error", "rejected"),
    (422, "validation_error", "rejected"), (401, "invalid_api_key", "auth"),
    (409, "invalid_idempotent_request", "rejected"), (409, "concurrent_idempotent_requests", "unavailable"),
    (500, "internal_server_error", "unavailable"), (503, "", "unavailable"),
])
def test_status_and_error_name_decide_the_outcome(status, name, outcome):
    body = {"id": "m1"} if status == 200 else {"statusCode": status, "name": name, "message": "x"}
    result = _provider(lambda req: httpx.Response(status, json=body, headers={"retry-after": "3"})).post(
        "/emails", b"{}", "re_k", "k")
    assert result.outcome == outcome and result.status == status


def test_lost_answer_is_unknown_and_refused_connection_is_unavailable():
    def read_timeout(req):
        raise httpx.ReadTimeout("late", request=req)

    def refused(req):
        raise httpx.ConnectError("refused", request=req)

    assert _provider(read_timeout).post("/emails", b"{}", "re_k", "k").outcome == "unknown"
    assert _provider(refused).post("/emails", b"{}", "re_k", "k").outcome == "unavailable"


def test_batch_body_is_deterministic_and_carries_the_routing_tags():
    p = ResendEmail("http://provider.test")
    msgs = [Outbound(f"id-{i}", "acme", "marketing", {"from": "a@b.co", "to": ["c@d.co"], "subject": "s",
                                                       "text": "t", "internal": "not sent"}) for i in (2, 1)]
    path, body = p.build(msgs, batch=True)
    assert path == "/emails/batch"
    assert body == p.build(list(reversed(msgs)), batch=True)[1]
    assert b'"internal"' not in body and b'{"name":"send_id","value":"id-1"}' in body
    with pytest.raises(ValueError, match="1..100"):
        p.build(msgs * 51, batch=True)


def test_redaction_removes_addresses_numbers_and_keys():
    text = redact('{"message": "bad to: jane.doe@example.com, +1 415 555 0123, key re_AbC123"}')
    assert "jane" not in text and "555" not in text and "AbC123" not in text


def test_every_non_2xx_is_logged_with_status_and_a_redacted_body(caplog):
    body = {"statusCode": 422, "name": "validation_error", "message": "Invalid `to`: jane@example.com"}
    with caplog.at_level("WARNING", logger="streams.providers"):
        _provider(lambda req: httpx.Response(422, json=body)).post("/emails", b"{}", "re_k", "k")
    [record] = caplog.records
    assert "422" in record.getMessage() and "validation_error" in record.getMessage()
    assert "jane@example.com" not in record.getMessage()
