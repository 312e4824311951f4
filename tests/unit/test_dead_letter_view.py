"""What operators are shown of a dead letter (the operator API, `streams dlq show`) keeps personal data out."""

from streams.ingest.operator_api import _letter
from streams.retry.dlq import DeadLetterRecord, describe, summary_line


def test_a_dead_letters_headers_are_shown_to_operators_redacted():
    """Given a dead letter whose last error quotes the recipient and whose producer set a header holding a phone
    number and a bearer token (headers travel with the record into the DLQ),
    When an operator looks at it through the admin API or the CLI,
    Then every header is listed, its identifying values replaced (before: the API showed them as written), and
    dispatch's own ids, offsets and times as written (redacted, they read as phone numbers)."""
    send_id = "01905512-3456-7abc-8def-0123456789ab"  # ids, offsets and times in ms would read as phone numbers
    record = DeadLetterRecord(0, 7, send_id, b'{"to": "ana@example.com"}', {
        "send_id": send_id, "reason": "permanent_error", "attempts": "3", "origin_offset": "123456789",
        "dead_lettered_at_ms": "1700000000000",
        "last_error": "422 invalid recipient ana@example.com",
        "x-origin": "call +14155550123 with Bearer abcdefghijklmnopqrstuvwxyz",
        # names dispatch writes too, set by the producer on its record with values of another shape
        "reason_detail": "alice@example.com", "due_at_ms": "+44 7700 900123"}, 1_700_000_000_000)
    for shown in (str(_letter(record)), describe(record)):
        assert "ana@example.com" not in shown and "4155550123" not in shown
        assert "alice@example.com" not in shown and "7700 900123" not in shown
        assert "abcdefghijklmnopqrstuvwxyz" not in shown
        assert "permanent_error" in shown and send_id in shown and "x-origin" in shown
    headers = _letter(record)["headers"]
    assert set(headers) == set(record.headers)
    assert {k: headers[k] for k in ("send_id", "attempts", "origin_offset", "dead_lettered_at_ms")} == {
        "send_id": send_id, "attempts": "3", "origin_offset": "123456789", "dead_lettered_at_ms": "1700000000000"}


def test_the_send_id_a_producer_gave_a_record_that_never_became_a_send_is_shown_redacted():
    """Given a record written to a lane directly, never a send, dead-lettered with its producer's own `send_id` header
    (an address) and `tenant` header (a phone number), as dispatch keeps them,
    When an operator looks at it through the admin API, `streams dlq show` or `streams dlq list`,
    Then neither is shown as written (before: the send id, and the list's tenant, were shown as written, beside
    the headers view that redacted them)."""
    record = DeadLetterRecord(0, 7, "jane.doe@example.test", b"{}", {
        "send_id": "jane.doe@example.test", "tenant": "+1 555 0100 777", "reason": "malformed"}, 1)
    for shown in (str(_letter(record)), describe(record), summary_line(record)):
        assert "jane.doe@example.test" not in shown and "0100 777" not in shown
