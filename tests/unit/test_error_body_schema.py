"""Every error answer the API builds fits the documented ErrorBody exactly (no field it does not
document), including the two fields only some 503s carry: `outcome` and `replayed`."""

import orjson
import pytest

from streams.errors import PublishError, ReplayOutcomeUnknown, StoreUnavailable
from streams.ingest.bulk import unavailable
from streams.ingest.web import ErrorBody, problem
from streams.webhooks.api import BulkReplayStopped, _stopped

REPLAYED = [{"delivery_id": "r-1", "replay_of": "d-1"}, {"delivery_id": "r-2", "replay_of": "d-2"}]


@pytest.mark.parametrize("cause", [ReplayOutcomeUnknown("no acknowledgement", "r-3"), PublishError("refused"),
                                   StoreUnavailable("redis down"), RuntimeError("a bug")])
def test_a_stopped_bulk_replay_answers_in_the_documented_shape(cause):
    """Given a bulk replay stopped after two replays, by each kind of failure,
    When it is answered,
    Then the body fits ErrorBody, and `replayed` holds the two replays as documented."""
    body = ErrorBody.model_validate(_stopped(BulkReplayStopped(REPLAYED, "d-3", cause)).detail)
    assert [r.model_dump() for r in body.replayed or []] == REPLAYED
    assert body.outcome == ("unknown" if isinstance(cause, ReplayOutcomeUnknown) else None)


@pytest.mark.parametrize("outcome", ["unknown", "applied"])
def test_an_answer_whose_outcome_is_not_nothing_changed_says_so_in_a_documented_field(outcome):
    detail = problem(503, "unavailable", [], "the broker did not confirm it", outcome=outcome).detail
    assert ErrorBody.model_validate(detail).outcome == outcome
    assert ErrorBody.model_validate(orjson.loads(unavailable("no answer", count=False, outcome=outcome).body)
                                    ).outcome == outcome


def test_the_openapi_describes_both_fields_and_nothing_else():
    """The published schema names `outcome` (its two values) and `replayed`, is closed to other fields, and
    offers neither null nor a default (an answer never carries them as null)."""
    schema = ErrorBody.model_json_schema()
    assert schema["additionalProperties"] is False and schema["required"] == ["error", "errors"]
    assert schema["properties"]["outcome"]["enum"] == ["unknown", "applied"]
    assert schema["properties"]["replayed"]["items"] == {"$ref": "#/$defs/ReplayedDelivery"}
    for name in ("outcome", "replayed"):
        assert "default" not in schema["properties"][name] and "anyOf" not in schema["properties"][name]
