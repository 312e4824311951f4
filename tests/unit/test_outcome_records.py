"""Outcome records stay within what the broker takes, whatever a lane event carries."""

import orjson
import pytest

from streams.dispatch.records import outcome_records
from streams.outcomes import OUTCOME_RECORD_BYTES, OUTCOMES_PER_RECORD, events_of
from streams.send import MalformedEvent, build_send, decode, encode, validate_request
from tests.harness import email_request


def test_a_requests_outcomes_are_split_by_size_as_well_as_by_count():
    """Given the outcomes of a request of 100 sends, each 17 kB (fields copied from what the lane event carried),
    When they are written,
    Then each record is at most about OUTCOME_RECORD_BYTES (before: one record of 1.7 MB, which the broker refused
    and the worker exited on, again after every restart), and together they hold every event, in order; 250 small
    events are split by count alone."""
    big = [{"send_id": f"s-{i}", "status": "delivered", "reason": "x" * 17_000} for i in range(100)]
    values = outcome_records(big)
    assert len(values) > 1 and all(len(v) <= OUTCOME_RECORD_BYTES + 17_100 for v in values)
    assert [e for v in values for e in events_of(orjson.loads(v))] == big
    small = [{"send_id": f"s-{i}", "status": "delivered"} for i in range(250)]
    values = outcome_records(small)
    assert [len(events_of(orjson.loads(v))) for v in values] == [OUTCOMES_PER_RECORD, OUTCOMES_PER_RECORD, 50]
    assert values[0] == orjson.dumps({"events": small[:OUTCOMES_PER_RECORD]})


@pytest.mark.parametrize("field", ["send_id", "replay_of"])
def test_a_lane_event_whose_send_id_cannot_be_one_is_malformed(field):
    """Given a lane event written by hand whose send id (or the id it replays) is 20 kB, or holds a space,
    When a worker reads it,
    Then it is malformed (dead-lettered, the partition moving on) rather than copied into outcome records."""
    doc = orjson.loads(encode(build_send(validate_request(email_request()), "acme")))
    for bad in ("x" * 20_000, "an id"):
        with pytest.raises(MalformedEvent, match=field):
            decode(orjson.dumps({**doc, field: bad}))
