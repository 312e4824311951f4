"""One operator change through the operator log and Redis (`write_through_log`), with fakes for both."""

import pytest

from streams.errors import StoreUnavailable
from streams.state.log import write_through_log


class Log:
    def __init__(self):
        self.puts: list[tuple[str, object]] = []

    def put(self, key, value) -> None:
        self.puts.append((key, value))


def refused() -> bool:
    raise StoreUnavailable("Redis unavailable (test)")


@pytest.mark.parametrize("deletes, taken_back", [(True, [("k", None)]), (False, [])])
def test_a_refused_first_write_is_taken_back_unless_redis_held_nothing_for_a_store_that_never_deletes(deletes,
                                                                                                     taken_back):
    """Given a record Redis held nothing for before (a create; or, for limits, a Redis that lost its data),
    When its Redis write is refused,
    Then a store whose changes may delete gets a tombstone after the record (a rebuild must not create what the
    operator was told failed), and one whose changes never delete (limits) keeps the record: Redis holding nothing
    is taken for its data lost, and a tombstone would take the limits a rebuild restores with it (the record is
    at least what the operator asked for)."""
    log = Log()
    with pytest.raises(StoreUnavailable):
        write_through_log(log, "k", {"v": 1}, refused, lambda: None, deletes=deletes)  # type: ignore[arg-type]
    assert log.puts == [("k", {"v": 1}), *taken_back]


def test_a_write_whose_answer_was_lost_is_taken_back_to_what_redis_holds_not_to_what_it_held():
    """Given a revocation whose compare-and-set ran in Redis and whose answer was then lost (a timeout), and
    Redis answering a read right after,
    When it is taken back,
    Then the log ends with what Redis holds, the revocation (before: the record read before it, the key unrevoked
    in the log while Redis had it revoked: a rebuild of Redis from the log made it valid again)."""
    log, redis = Log(), {"k": b'{"revoked_at_ms": null}'}

    def applied_then_lost() -> bool:
        redis["k"] = b'{"revoked_at_ms": 5}'
        raise StoreUnavailable("Redis unavailable (timeout, test)")

    with pytest.raises(StoreUnavailable):
        write_through_log(log, "k", {"revoked_at_ms": 5}, applied_then_lost, lambda: redis["k"],  # type: ignore[arg-type]
                          kept_if_unknown={"revoked_at_ms": None})
    assert log.puts[-1] == ("k", {"revoked_at_ms": 5})
