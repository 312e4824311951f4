"""`by_state`: what a message met before an attempt becomes, from its send's processed_jobs state. One rule for
the dispatch round and for copies moved off a long receiver hold."""

import pytest

from streams.dispatch.requests import by_state


@pytest.mark.parametrize("state, attempt, too_old, verdict", [
    (None, 1, False, "send"),
    (None, 1, True, "too_old"),
    ("delivered", 1, False, "duplicate"),
    ("delivered", 3, True, "duplicate"),        # an old copy of a delivered send: never a dead letter
    ("tried:2", 2, False, "stale"),             # attempt 2 was made and its retry copy is durable
    ("tried:2", 1, True, "stale"),
    ("tried:2", 3, False, "send"),              # the copy that carries the send on
    ("tried:2", 3, True, "too_old"),            # its attempts failed definitely: merely too old
    ("inflight:send-k", 1, False, "held"),      # another request holds it: recover it or wait
    ("inflight:send-k", 1, True, "unknown_outcome"),  # the provider may hold it: never `too_old`
    ("reconcile", 1, False, "unknown_outcome"),
    ("reconcile", 1, True, "unknown_outcome"),
])
def test_each_state_decides_what_the_message_becomes(state, attempt, too_old, verdict):
    assert by_state(state, attempt, too_old) == verdict
