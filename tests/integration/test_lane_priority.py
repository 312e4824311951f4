"""Transactional always wins: marketing workers yield while the transactional lag is above the
threshold (keeping partitions paused across rebalances) and resume after it recovers."""

import signal
import time

import orjson

from tests.harness import committed_lag, email_request, free_port, metric, read_topic, wait_until

BLAST = 4_000
BACKLOG = 300
YIELD_ENV = {"YIELD_PAUSE_ABOVE": "50", "YIELD_RESUME_BELOW": "5", "YIELD_MIN_DWELL_S": "1",
             "YIELD_STALE_AFTER_S": "3"}


def _setup(channel_topics, limits, mock_provider, processes):
    channel_topics("email")
    mock_provider.reset(rate=20, latency_ms=50)
    limits.set_provider("resend", 20, 20)
    limits.set_tenant("resend", "*", 100_000, 20)  # batches of 20: a blast takes ~200 requests
    processes.env.update(YIELD_ENV)


def _marketing_times(mock_provider, ids) -> list[float]:
    deliveries = mock_provider.stats(deliveries=True)["deliveries"]
    return sorted(t for i in ids for t in deliveries.get(i, []))


def _first_crossing_ms(stack, names) -> int:
    for m in read_topic(stack.bootstrap, names.lag, expect=1):
        doc = orjson.loads(m.value())
        if m.key() == b"email.transactional" and doc["lag_messages"] >= 50:
            return doc["ts"]
    raise AssertionError("no lag reading above the threshold was published")


def test_marketing_yields_stays_paused_through_a_rebalance_and_resumes(
        stack, names, channel_topics, limits, processes, send_client, mock_provider):
    """Given a lag monitor, workers told to yield above a transactional lag of 50, and a marketing worker with at least
    400 emails of a 4,000-email blast delivered,
    When 300 transactional emails pile up with no transactional worker, and a second marketing worker joins and then
    leaves while the lane is paused,
    Then marketing yields and stays paused through the rebalance (every partition of both workers paused, all 6 back on
    the first worker and still paused), its deliveries stop within 3 s of the lag crossing the threshold, and once a
    transactional worker drains the backlog marketing resumes: all 300 transactional emails and the whole blast are
    delivered exactly once."""
    _setup(channel_topics, limits, mock_provider, processes)
    processes.start("lag-monitor", "lag-monitor", "--interval", "0.25")
    p1, p2 = free_port(), free_port()
    processes.worker("email", "marketing", "--metrics-port", str(p1))
    blast = []
    for _ in range(BLAST // 1000):
        blast += send_client.publish_batch("blaster", [email_request("marketing")] * 1000)
    wait_until(lambda: len(_marketing_times(mock_provider, blast)) >= 400, 60, "the blast to be under way")

    # When a transactional backlog builds up (no transactional worker yet)
    otps = send_client.publish_batch("shop", [email_request("transactional")] * BACKLOG)
    wait_until(lambda: metric(p1, "dispatch_lane_paused", lane="marketing", reason="yield") == 1, 10,
               "the marketing worker to yield")
    crossed_s = _first_crossing_ms(stack, names) / 1000

    # And a second marketing worker joins, then leaves, while the lane is paused
    second = processes.worker("email", "marketing", "--metrics-port", str(p2))
    wait_until(lambda: (metric(p2, "dispatch_worker_assigned_partitions") or 0) > 0, 30, "worker 2's assignment")
    for port in (p1, p2):
        wait_until(lambda port=port: metric(port, "dispatch_worker_paused_partitions")
                   == metric(port, "dispatch_worker_assigned_partitions"), 10, "every partition to be paused")
    second.send_signal(signal.SIGTERM)
    assert second.wait(30) == 0
    wait_until(lambda: metric(p1, "dispatch_worker_assigned_partitions") == 6, 30, "worker 1 to take all back")
    assert metric(p1, "dispatch_worker_paused_partitions") == 6

    # Then marketing deliveries stopped within 3 s of the crossing and none happened while paused
    during = _marketing_times(mock_provider, blast)
    assert during and during[-1] <= crossed_s + 3.0, f"last marketing delivery {during[-1] - crossed_s:.2f} s after"
    assert len(during) < BLAST

    # When the transactional lane recovers, marketing resumes and finishes
    processes.worker("email", "transactional")
    wait_until(lambda: metric(p1, "dispatch_lane_paused", lane="marketing", reason="yield") == 0, 30,
               "marketing to resume")
    wait_until(lambda: len(_marketing_times(mock_provider, blast)) >= BLAST, 120, "the whole blast")
    stats = mock_provider.stats(deliveries=True)
    assert all(i in stats["deliveries"] for i in otps)
    # The batch in flight at the pause completed: nothing lost, nothing sent twice
    assert stats["distinct_sends"] == BLAST + BACKLOG and stats["duplicate_deliveries"] == 0


def test_a_marketing_worker_started_while_its_lane_yields_reads_nothing(
        stack, names, channel_topics, limits, processes, send_client, mock_provider):
    """Given a lag monitor, workers told to yield above a transactional lag of 50, 300 transactional emails waiting
    with no transactional worker, and a 1,000-email blast waiting on the marketing lane,
    When a marketing worker starts (its first assignment, as after a deploy or a crash),
    Then it holds its partitions paused and reads nothing from them for 5 s (no message buffered, none parked on a
    retry tier, none delivered); before, a new consumer's pause in its first assignment was skipped by librdkafka, and
    the worker read the blast while reporting every partition paused. Once a transactional worker drains the backlog,
    the blast is delivered exactly once."""
    _setup(channel_topics, limits, mock_provider, processes)
    processes.start("lag-monitor", "lag-monitor", "--interval", "0.25")
    otps = send_client.publish_batch("shop", [email_request("transactional")] * BACKLOG)
    blast = send_client.publish_batch("blaster", [email_request("marketing")] * 1000)
    port = free_port()
    processes.worker("email", "marketing", "--metrics-port", str(port))
    wait_until(lambda: metric(port, "dispatch_lane_paused", lane="marketing", reason="yield") == 1, 20,
               "the new worker to yield")
    wait_until(lambda: metric(port, "dispatch_worker_assigned_partitions") == 6, 30, "its assignment")
    assert metric(port, "dispatch_worker_paused_partitions") == 6

    deadline = time.monotonic() + 5.0  # how long "reads nothing" is watched for, not a wait for something
    while time.monotonic() < deadline:
        assert (metric(port, "dispatch_worker_buffered_messages", lane="marketing") or 0) == 0, "it read the blast"
        assert (metric(port, "dispatch_spilled_total") or 0) == 0, "it parked what it read"
        time.sleep(0.2)
    assert not any(i in mock_provider.stats(deliveries=True)["deliveries"] for i in blast)

    processes.worker("email", "transactional")
    wait_until(lambda: len(_marketing_times(mock_provider, blast)) >= len(blast), 120, "the whole blast")
    stats = mock_provider.stats(deliveries=True)
    assert all(i in stats["deliveries"] for i in otps) and stats["duplicate_deliveries"] == 0


def test_stale_lag_monitor_makes_workers_read_lag_directly(stack, names, channel_topics, limits, processes,
                                                           send_client, mock_provider):
    """Given a marketing worker receiving fresh transactional lag readings from the lag monitor,
    When the monitor is killed so that its reading goes stale,
    Then the worker shows the stale reading in its metrics, keeps delivering a 1,000-email blast, still yields on its
    own lag reading when 300 transactional emails pile up, resumes once a transactional worker drains them, and
    finishes the blast with no duplicate delivery."""
    _setup(channel_topics, limits, mock_provider, processes)
    monitor = processes.start("lag-monitor", "lag-monitor", "--interval", "0.25")
    port = free_port()
    processes.worker("email", "marketing", "--metrics-port", str(port))
    wait_until(lambda: metric(port, "dispatch_lag_reading_stale", channel="email") == 0, 20,
               "a fresh reading from the monitor")

    # When the monitor dies, the reading goes stale, and that is visible
    monitor.send_signal(signal.SIGKILL)
    monitor.wait(10)
    wait_until(lambda: metric(port, "dispatch_lag_reading_stale", channel="email") == 1, 20,
               "the stale reading to show in metrics")

    # Then marketing still runs (not starved) ...
    blast = send_client.publish_batch("blaster", [email_request("marketing")] * 1000)
    wait_until(lambda: len(_marketing_times(mock_provider, blast)) >= 100, 30, "marketing to run while stale")
    # ... and still yields (not blind): the worker measures the transactional lag itself
    send_client.publish_batch("shop", [email_request("transactional")] * BACKLOG)
    wait_until(lambda: metric(port, "dispatch_lane_paused", lane="marketing", reason="yield") == 1, 10,
               "the worker to yield on its own reading")
    processes.worker("email", "transactional")
    wait_until(lambda: metric(port, "dispatch_lane_paused", lane="marketing", reason="yield") == 0, 30,
               "marketing to resume on its own reading")
    wait_until(lambda: committed_lag(stack.bootstrap, names.group("email", "marketing"),
                                     names.lane("email", "marketing")) == 0, 120, "the blast to finish")
    assert mock_provider.stats()["duplicate_deliveries"] == 0


def test_marketing_roles_give_up_cpu_priority_and_transactional_ones_keep_it(channel_topics, processes):
    """Given both lanes' workers and retriers started as an operator starts them (the default settings), and a second
    marketing worker started with DUAL_RAIL_MARKETING_NICE=0,
    When their CPU priorities are read from the operating system,
    Then the marketing worker and retrier run at nice 10, the transactional ones at nice 0 (when both share a host,
    a blast's CPU use never delays an OTP), and the setting turns it off. Each runs in a session of its own, so with
    autogroup scheduling its session's group has the same nice value (or nice would hold only within it)."""
    import os
    from pathlib import Path

    channel_topics("email")
    roles = {(role, lane): start("email", lane) for lane in ("transactional", "marketing")
             for role, start in (("worker", processes.worker), ("retrier", processes.retrier))}
    unniced = processes.worker("email", "marketing", env={"DUAL_RAIL_MARKETING_NICE": "0"})

    assert {key: os.getpriority(os.PRIO_PROCESS, proc.pid) for key, proc in roles.items()} == {
        ("worker", "transactional"): 0, ("retrier", "transactional"): 0,
        ("worker", "marketing"): 10, ("retrier", "marketing"): 10}
    assert os.getpriority(os.PRIO_PROCESS, unniced.pid) == 0
    if Path(f"/proc/{unniced.pid}/autogroup").exists():  # a kernel with autogroup scheduling
        assert {key: Path(f"/proc/{proc.pid}/autogroup").read_text().split()[-1] for key, proc in roles.items()} == {
            ("worker", "transactional"): "0", ("retrier", "transactional"): "0",
            ("worker", "marketing"): "10", ("retrier", "marketing"): "10"}


def test_otps_are_not_queued_behind_a_few_slow_provider_answers(channel_topics, limits, processes, send_client,
                                                              mock_provider):
    """Given a transactional email worker started with the default settings and a provider that accepts requests but
    holds every answer (slowed down, as under a blast),
    When 20 OTPs arrive at once,
    Then all 20 requests are at the provider together (the lane keeps as many single sends in flight as providers.toml
    allows one worker, 32 for Resend, not 8), and once the answers come each OTP is delivered exactly once."""
    channel_topics("email")
    mock_provider.reset(rate=1000)
    limits.set_provider("resend", 1000, 1000)
    limits.set_tenant("resend", "*", 1000, 1000)
    mock_provider.configure(hold_answers=True)
    processes.worker("email", "transactional", env={"PROVIDER_TIMEOUT_S": "60"})  # no answer is given up meanwhile
    ids = send_client.publish_batch("shop", [email_request("transactional")] * 20)

    try:
        wait_until(lambda: mock_provider.stats()["held"] == 20, 30, "all 20 OTP requests at the provider together")
    finally:
        mock_provider.configure(hold_answers=False)
    wait_until(lambda: mock_provider.stats()["distinct_sends"] == 20, 30, "every OTP to be delivered")
    stats = mock_provider.stats(deliveries=True)
    assert set(stats["deliveries"]) == set(ids)
    assert stats["duplicate_deliveries"] == 0
