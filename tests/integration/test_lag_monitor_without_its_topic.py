"""A lag monitor whose topic is missing (or denied) keeps running: the readings it cannot publish go stale, visibly,
and the lanes' lag on /metrics goes on."""

from prometheus_client import REGISTRY

from streams.lag.monitor import LagMonitor
from tests.harness import wait_until


def test_a_lag_monitor_without_its_topic_keeps_measuring_and_goes_stale_rather_than_crash(stack, names, create_topics):
    """Given the email lanes on the real broker but no notif.lag topic (not created yet, or denied by an ACL),
    When the lag monitor takes its readings, again and again,
    Then once the broker has said the topic does not exist every publication is refused at once, and the monitor
    counts each as a failed publication (its channel's freshness stays where it was: LagMonitorStale fires) while it
    goes on showing the lanes' lag; before, the refusal raised out of its loop and the process exited, at every
    restart, taking the lanes' lag metrics and the retry tiers' watch with it."""
    create_topics({names.lane("email", lane): 1 for lane in ("transactional", "marketing")})
    monitor = LagMonitor(stack.bootstrap, names, channels=("email",))
    stamp = REGISTRY.get_sample_value("dispatch_lag_monitor_last_publish_timestamp_seconds", {"channel": "email"})
    try:
        in_a_row = [0]

        def refused_tick_after_tick() -> bool:
            # librdkafka waits up to 30 s (topic.metadata.propagation.max.ms) for the topic to appear, then fails
            # what it queued and refuses every later produce at once, inside tick().
            before = monitor.publish_outage.attempts
            monitor.tick()
            in_a_row[0] = in_a_row[0] + 1 if monitor.publish_outage.attempts > before else 0
            return in_a_row[0] >= 5

        wait_until(refused_tick_after_tick, 60, "publications to notif.lag to be refused tick after tick", interval=0.1)
        assert REGISTRY.get_sample_value("dispatch_lag_monitor_last_publish_timestamp_seconds",
                                         {"channel": "email"}) == stamp
        assert REGISTRY.get_sample_value("dispatch_lane_lag_messages",
                                         {"channel": "email", "lane": "transactional"}) == 0
    finally:
        monitor.producer.flush(1)
        monitor.reader.close()
