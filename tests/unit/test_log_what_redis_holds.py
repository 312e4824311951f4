"""A compare-and-set change of operator state ends by logging what Redis holds, read again until it holds
still, so that the writer that touched Redis last also logs last (a stale put-back of another writer, or a
deletion racing two changes, never stays the operator log's last word)."""

import pytest

from streams.errors import PublishError
from streams.state.log import log_what_redis_holds


class Log:
    def __init__(self, fail: bool = False):
        self.puts, self.fail = [], fail

    def put(self, key, value):
        if self.fail:
            raise PublishError("the broker did not acknowledge")
        self.puts.append((key, value))


def reads(*values):
    it = iter(values)
    return lambda: next(it)


def test_what_redis_holds_is_logged_again_until_it_holds_still():
    """Given Redis changing under the put-back (a record, then a deletion by another writer, then still none),
    When the change logs what Redis holds,
    Then the log gets the record, then the deletion, and stops once two reads agree."""
    log = Log()
    log_what_redis_holds(log, "endpoint/ep_1", reads(b'{"v": 1}', None, None), after_success=False)  # type: ignore[arg-type]
    assert log.puts == [("endpoint/ep_1", {"v": 1}), ("endpoint/ep_1", None)]


def test_a_log_write_failing_after_a_successful_change_does_not_fail_the_change():
    log_what_redis_holds(Log(fail=True), "apikey/x", reads(b"{}"), after_success=True)  # type: ignore[arg-type]
    with pytest.raises(PublishError):
        log_what_redis_holds(Log(fail=True), "apikey/x", reads(b"{}"), after_success=False)  # type: ignore[arg-type]
