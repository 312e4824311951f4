"""What operators are shown of a dead letter (the operator API, `streams dlq show`) keeps personal data out."""

from streams.ingest.operator_api import _letter
from streams.retry.dlq import DeadLetterRecord, describe


def test_a_dead_letters_headers_are_shown_to_operators_redacted():
    """Given a dead letter whose last error quotes the recipient and whose producer set a header holding a phone
    number and a bearer token (headers travel with the record into the DLQ),
    When an operator looks at it through the admin API or the CLI,
    Then every header is listed, its identifying values replaced (before: the API showed them as written)."""
    record = DeadLetterRecord(0, 7, "s-1", b'{"to": "ana@example.com"}', {
        "send_id": "s-1", "reason": "permanent_error", "attempts": "3",
        "last_error": "422 invalid recipient ana@example.com",
        "x-origin": "call +14155550123 with Bearer abcdefghijklmnopqrstuvwxyz"}, 1_700_000_000_000)
    for shown in (str(_letter(record)), describe(record)):
        assert "ana@example.com" not in shown and "4155550123" not in shown
        assert "abcdefghijklmnopqrstuvwxyz" not in shown
        assert "permanent_error" in shown and "s-1" in shown and "x-origin" in shown
    headers = _letter(record)["headers"]
    assert set(headers) == set(record.headers) and headers["attempts"] == "3"
