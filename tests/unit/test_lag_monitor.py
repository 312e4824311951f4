"""The lag monitor says, channel by channel, which lag it could not read: it never shows an old reading as
current, and its staleness names the channel."""

import time

from prometheus_client import REGISTRY

from streams.lag.monitor import LagMonitor
from streams.lag.yield_policy import LagReading, YieldPolicy
from streams.names import TopicNames
from tests.harness import AcknowledgingProducer, wait_until


class ChannelReader:
    """Lag readings of every lane, except those of the channels in `failing` (their group's coordinator away)."""

    def __init__(self):
        self.failing: set[str] = set()

    def read(self, group, topic, source="monitor"):
        if any(f".{c}." in topic for c in self.failing):
            raise RuntimeError("coordinator not available")
        return LagReading(3, 0.5, int(time.time() * 1000), source)

    def close(self):
        pass


def reading_every_lane(monitor, reader):
    """`reader` in place of each lane's own (their consumers closed)."""
    for lane, own in monitor.readers.items():
        own.close()
        monitor.readers[lane] = reader
    return reader


def _sample(name, **labels):
    return REGISTRY.get_sample_value(name, labels)


def test_a_channel_whose_lag_cannot_be_read_goes_stale_alone_and_shows_no_old_reading():
    """Given a monitor publishing email's and sms's lag,
    When sms's lag can no longer be read (email's still can),
    Then sms's publication timestamp stops while email's goes on (before: one timestamp for all channels, kept
    fresh by email, so LagMonitorStale never fired for sms), and sms's lane lag gauges are gone rather than
    frozen at their last value (which the lag alerts would have gone on reading)."""
    monitor = LagMonitor("127.0.0.1:9", TopicNames("monitor-test."), channels=("email", "sms"))
    monitor.producer = AcknowledgingProducer()
    reader = reading_every_lane(monitor, ChannelReader())
    started = _sample("dispatch_lag_monitor_last_publish_timestamp_seconds", channel="sms")
    assert started is not None  # a channel never published goes stale from the monitor's start (not absent)
    time.sleep(0.01)
    monitor.tick()
    monitor.producer.poll()
    stamp = "dispatch_lag_monitor_last_publish_timestamp_seconds"
    first = {c: _sample(stamp, channel=c) for c in ("email", "sms")}
    assert None not in first.values()
    assert _sample("dispatch_lane_lag_messages", channel="sms", lane="transactional") == 3

    reader.failing.add("sms")
    time.sleep(0.01)  # the next publication's wall-clock time differs from the first's
    monitor.tick()
    monitor.producer.poll()
    assert _sample(stamp, channel="email") > first["email"]
    assert _sample(stamp, channel="sms") == first["sms"]
    assert _sample("dispatch_lane_lag_messages", channel="sms", lane="transactional") is None
    assert _sample("dispatch_lane_lag_seconds", channel="sms", lane="marketing") is None
    assert _sample("dispatch_lane_lag_messages", channel="email", lane="transactional") == 3


def test_a_reading_acknowledged_late_is_as_fresh_as_when_it_was_taken():
    """Given a broker slow to acknowledge (a follower behind: acks=all), whose acknowledgement of a reading taken
    4 s ago comes now,
    When the monitor's freshness is exported,
    Then it is 4 s old, as old as the workers find the reading (before: stamped at the acknowledgement, fresh, and
    LagMonitorStale kept quiet while every worker set the readings aside as stale)."""
    monitor = LagMonitor("127.0.0.1:9", TopicNames("monitor-test."), channels=("webhook",))
    taken_ms = int(time.time() * 1000) - 4_000
    reading_every_lane(monitor, type("Slow", (ChannelReader,), {
        "read": lambda self, group, topic, source="monitor": LagReading(3, 0.5, taken_ms, source)})())
    monitor.producer = AcknowledgingProducer()
    monitor.tick()
    monitor.producer.poll()
    assert _sample("dispatch_lag_monitor_last_publish_timestamp_seconds", channel="webhook") == taken_ms / 1000


class RefusingProducer(AcknowledgingProducer):
    """librdkafka once it has found the topic missing (or denied): every produce to it refused at once."""

    def produce(self, topic, value=None, key=None, headers=None, on_delivery=None):
        from confluent_kafka import KafkaError, KafkaException
        raise KafkaException(KafkaError(KafkaError._UNKNOWN_TOPIC, "Local: Unknown topic"))


def test_a_monitor_whose_topic_is_missing_keeps_measuring_and_goes_stale_rather_than_crash():
    """Given a monitor whose producer refuses every publication at once (notif.lag missing or denied by an ACL:
    librdkafka does so 30 s after the first produce to a topic it found missing),
    When it takes its readings, again and again,
    Then each refusal counts as a failed publication (the channel's freshness stays where it was: LagMonitorStale
    fires) and the lanes' lag is still exported; before, the refusal raised out of its loop and the process exited,
    at every restart, taking the lanes' lag and the retry tiers' watch with it."""
    monitor = LagMonitor("127.0.0.1:9", TopicNames("monitor-test."), channels=("email",))
    monitor.producer = RefusingProducer()
    reading_every_lane(monitor, ChannelReader())
    stamp = "dispatch_lag_monitor_last_publish_timestamp_seconds"
    started = _sample(stamp, channel="email")
    for _ in range(3):
        monitor.tick()
    assert monitor.publish_outage.attempts == 3
    assert _sample(stamp, channel="email") == started
    assert _sample("dispatch_lane_lag_messages", channel="email", lane="marketing") == 3


STALE_AFTER_S = YieldPolicy().stale_after_s  # a reading older than this, marketing workers set aside


class StuckReader(ChannelReader):
    """A lane whose reads do not return until released (its group's coordinator away: 5 s a call)."""

    def __init__(self):
        super().__init__()
        import threading

        self.release = threading.Event()

    def read(self, group, topic, source="monitor"):
        self.release.wait(10)
        return super().read(group, topic, source)


def test_a_lane_slow_to_read_holds_back_no_other_channels_reading():
    """Given a monitor of email and sms whose read of email's marketing lane does not return (its group's coordinator
    away),
    When it takes its readings, twice,
    Then sms's and email's transactional lag are published both times, fresh (before: each lane was read in turn,
    and every channel waited for the one slow read: every reading aged past what workers accept, and every marketing
    worker fell back to reading the lag itself); once the slow read returns, its lane's lag is shown."""
    monitor = LagMonitor("127.0.0.1:9", TopicNames("monitor-test."), channels=("email", "sms"))
    monitor.producer = AcknowledgingProducer()
    reading_every_lane(monitor, ChannelReader())
    stuck = monitor.readers["email", "marketing"] = StuckReader()
    stamp = "dispatch_lag_monitor_last_publish_timestamp_seconds"
    metrics_before = {c: _sample(stamp, channel=c) for c in ("email", "sms")}
    try:
        for _ in range(2):
            time.sleep(0.01)  # the next publication's wall-clock time differs
            begun = int(time.time() * 1000) / 1000  # readings are stamped in ms
            monitor.tick()
            monitor.producer.poll()
            assert time.time() - begun < STALE_AFTER_S  # the tick did not wait for the slow read
            for channel in ("email", "sms"):
                published = _sample(stamp, channel=channel)
                assert begun <= published < begun + STALE_AFTER_S and published > metrics_before[channel]
                metrics_before[channel] = published
    finally:
        stuck.release.set()
    wait_until(lambda: monitor.tick() or _sample("dispatch_lane_lag_messages", channel="email", lane="marketing"),
               10, "the slow lane's reading")
    monitor._pool.shutdown(wait=True)
