"""The ingest publisher's view of each topic's max.message.bytes never holds a request while the broker is
slow: only a topic's first look waits for the broker (off the event loop), and a failed look is not repeated
by every request."""

import threading
import time
from concurrent.futures import Future

from streams.ingest import publisher
from streams.ingest.publisher import MAX_RECORD_BYTES, SIZES_TTL_S, TopicSizes


class SlowAdmin:
    """A broker that takes its time: describe_configs answers nothing until `answer` is set."""

    def __init__(self):
        self.asked = 0
        self.answer = threading.Event()

    def describe_configs(self, resources):
        self.asked += 1
        done: Future = Future()

        def later():
            if self.answer.wait(5):
                done.set_result({"max.message.bytes": type("V", (), {"value": "2000000"})()})

        threading.Thread(target=later, daemon=True).start()
        return {resources[0]: done}


def test_an_expired_size_is_served_at_once_while_one_background_read_refreshes_it():
    """Given a size read a while ago (past its TTL) and a broker that is slow to answer,
    When fifty requests ask for the topic's size,
    Then each gets the known size at once, and the broker is asked once (before, each request waited up to
    10 s for the broker, on the API's event loop: every other request of the process waited with it)."""
    admin = SlowAdmin()
    sizes = TopicSizes(admin, read_timeout_s=5)
    sizes.sizes["lane"] = (time.monotonic() - SIZES_TTL_S - 1, 1_000_000)
    started = time.monotonic()
    assert [sizes.limit("lane") for _ in range(50)] == [1_000_000] * 50
    assert time.monotonic() - started < 2.5 and admin.asked == 1  # not the read's 5 s
    admin.answer.set()
    deadline = time.monotonic() + 5
    while sizes.limit("lane") != 2_000_000 and time.monotonic() < deadline:
        admin.answer.wait(0.01)
    assert sizes.limit("lane") == 2_000_000


def test_a_first_look_that_fails_is_not_repeated_by_every_request(monkeypatch):
    """Given a broker that does not answer,
    When a topic's size is first asked for, and again at once,
    Then the first waits for the read's timeout and assumes the producer's own limit, and the second gets that
    at once, without asking the broker again (it is looked at again in the background after a few seconds)."""
    admin = SlowAdmin()
    sizes = TopicSizes(admin, read_timeout_s=2)
    assert sizes.limit("lane") == MAX_RECORD_BYTES
    started = time.monotonic()
    assert sizes.limit("lane") == MAX_RECORD_BYTES
    assert time.monotonic() - started < 1 and admin.asked == 1  # not the read's 2 s
    assert publisher.SIZES_RETRY_S < SIZES_TTL_S
