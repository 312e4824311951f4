"""A marketing worker never runs blind: without a fresh transactional lag reading it sends nothing."""

import time
from types import SimpleNamespace

import orjson

from streams.dispatch.pauses import LanePauses
from streams.lag.yield_policy import LagReading, YieldPolicy
from streams.names import TopicNames, lag_key
from tests.harness import PauseRecordingConsumer


class Follower:
    """notif.lag as the worker's follower reads it: the given records once."""

    def __init__(self, docs):
        self.docs = list(docs)

    def consume(self, num_messages=1, timeout=0):
        docs, self.docs = self.docs, []
        return [SimpleNamespace(error=lambda: None, key=lambda: lag_key("email").encode(),
                                value=lambda d=d: orjson.dumps(d), topic=lambda: "notif.lag", offset=lambda: 0)
                for d in docs]

    def close(self):
        pass


class Direct:
    """The background direct read: `reading` once asked for, or nothing (the broker not answering)."""

    def __init__(self):
        self.reading, self.asked = None, 0

    def request(self):
        self.asked += 1

    def take(self):
        reading, self.reading = self.reading, None
        return reading

    def close(self):
        pass


def _marketing_pauses(reading_age_ms: int, partitions: int = 1):
    """A marketing lane's pauses whose follower reads back one lag reading of that age, its direct read silent."""
    consumer = PauseRecordingConsumer()
    pauses = LanePauses(consumer, "127.0.0.1:9", TopicNames(), "email", "marketing", YieldPolicy(stale_after_s=3.0))
    pauses.on_assign([SimpleNamespace(topic="notif.email.marketing", partition=p) for p in range(partitions)])
    pauses._follower.close()
    pauses._direct.close()
    now = int(time.time() * 1000)
    pauses._follower = Follower([{"lag_messages": 0, "lag_seconds": 0.0, "ts": now - reading_age_ms}])
    pauses._direct = direct = Direct()
    return pauses, consumer, direct


def test_a_worker_whose_only_reading_is_old_sends_nothing_until_a_fresh_one():
    """Given a marketing worker starting while the monitor is silent: its follower reads back a 10-minute-old
    record of the compacted lag topic, and the direct read of the lag has not answered yet,
    When it decides,
    Then it sends nothing and asks for a direct read (before, the old reading counted as its first reading and
    it dispatched marketing blind, whatever the transactional lag was), and its partitions are paused (it read
    on, and parked everything past each tenant's share on a retry tier, which brought it back to be parked
    again); once a fresh reading of lag 0 arrives it runs."""
    pauses, consumer, direct = _marketing_pauses(600_000, partitions=2)
    pauses.follow_lag()
    pauses.apply()
    assert pauses.without_reading and direct.asked == 1
    assert consumer.paused == {("notif.email.marketing", 0), ("notif.email.marketing", 1)}  # nor reads (spills)
    direct.reading = LagReading(0, 0.0, int(time.time() * 1000), "direct")
    pauses.follow_lag()
    pauses.apply()
    assert not pauses.without_reading and not pauses.yielding and consumer.paused == set()
    pauses.close()


def test_a_silent_monitors_last_reading_is_followed_by_a_direct_one_before_it_goes_stale():
    """With the monitor silent, the direct read was asked for only once the last reading was stale: every few
    seconds the lane paused its partitions (purging their fetch queues) until the read came back. Now it is asked
    for once the reading is past half the age it may have, and the lane does not stop."""
    pauses, consumer, direct = _marketing_pauses(2_000)
    pauses.follow_lag()
    pauses.apply()
    assert direct.asked == 1 and not pauses.without_reading and consumer.paused == set()
    pauses.close()


def test_a_marketing_worker_starts_with_its_partitions_paused_until_its_first_reading():
    """Given a marketing worker that has just started (no lag reading followed yet),
    When its first poll assigns it partitions (before anything has followed the lag),
    Then they start paused (before: resumed, and that poll and the next read up to 500 sends, each tenant's excess
    parked on a retry tier while the transactional lag might be high); a fresh reading of lag 0 resumes them."""
    consumer = PauseRecordingConsumer()
    pauses = LanePauses(consumer, "127.0.0.1:9", TopicNames(), "email", "marketing", YieldPolicy(stale_after_s=3.0))
    pauses.on_assign([SimpleNamespace(topic="notif.email.marketing", partition=p) for p in range(2)])
    assert consumer.paused == {("notif.email.marketing", 0), ("notif.email.marketing", 1)}
    pauses._follower.close()
    pauses._direct.close()
    pauses._follower = Follower([{"lag_messages": 0, "lag_seconds": 0.0, "ts": int(time.time() * 1000)}])
    pauses._direct = Direct()
    pauses.follow_lag()
    pauses.apply()
    assert consumer.paused == set() and not pauses.reasons
    pauses.close()


def test_the_stale_gauge_says_so_when_the_workers_clock_stepped_back_and_every_reading_is_refused(monkeypatch):
    """Given a marketing worker that followed a fresh reading of the monitor,
    When its clock steps back a minute (the monitor's readings, stamped by a clock that did not, are then refused
    as stamped ahead) and the stale age (3 s) passes,
    Then `dispatch_lag_reading_stale` says 1: the worker has followed nothing of the monitor's for longer than
    that (before, it said 0 until the worker's clock was back at the last reading, a minute later)."""
    from streams import metrics
    from streams.dispatch import pauses as pauses_module

    pauses, _, _ = _marketing_pauses(0)
    pauses.follow_lag()
    stale = metrics.LAG_READING_STALE.labels("email")
    assert stale._value.get() == 0
    real = time.time()
    for behind_s in (60.0, 56.0):  # stepped back a minute, then 4 s later; the monitor's clock did not step
        monitor_ms = int((real + 60.0 - behind_s) * 1000)
        pauses._follower = Follower([{"lag_messages": 0, "lag_seconds": 0.0, "ts": monitor_ms}])
        monkeypatch.setattr(pauses_module.time, "time", lambda b=behind_s: real - b)
        pauses.follow_lag()
    assert stale._value.get() == 1
    pauses.close()
