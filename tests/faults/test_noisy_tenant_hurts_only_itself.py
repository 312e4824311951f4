"""One tenant's throttled backlog hurts only that tenant: its excess is parked on a retry tier, so the
worker's buffer never fills, its neighbours on the same partition go out at once, and the lane's
committed offset moves on (the lag does not count work held back by one tenant's own limit)."""

import time

from tests.harness import committed_lag, email_request, free_port, metric, wait_until

FLOOD = 50_000
NEIGHBOUR = 200


def test_a_flooding_throttled_tenant_does_not_stall_its_partition(
        fault_stack, fault_runtime, fault_topics, fault_processes, mock_provider, names):
    """Given one marketing partition, tenant A throttled to 5 messages/s publishing 50,000 sends and then
    tenant B publishing 200,
    When one marketing worker (with a lag monitor and a retrier) works through them,
    Then all of B's sends are delivered within 30 s of publishing, the worker never pauses for backpressure,
    A is held to its own limit, and the group's committed lag falls below the yield threshold (100)
    once B is done."""
    fault_topics("email", lane_partitions=1)
    mock_provider.reset(rate=1000)
    limits = fault_runtime.limit_store()
    limits.set_provider("resend", 1000, 1000)
    limits.set_tenant("resend", "*", 10_000, 100)
    limits.set_tenant("resend", "flooder", 5, 5)
    port = free_port()
    fault_processes.start("lag-monitor", "lag-monitor", ready="lag monitor publishing")
    fault_processes.worker("email", "marketing", "--metrics-port", str(port))
    fault_processes.retrier("email", "marketing")
    client = fault_runtime.send_client()
    flood_started = time.monotonic()
    for _ in range(FLOOD // 1000):
        client.publish_batch("flooder", [email_request("marketing")] * 1000)
    started = time.monotonic()
    neighbour = client.publish_batch("neighbour", [email_request("marketing")] * NEIGHBOUR)

    wait_until(lambda: set(neighbour) <= set(mock_provider.stats(deliveries=True)["deliveries"]),
               30 - (time.monotonic() - started), "the neighbour's sends within 30 s of their publication",
               interval=0.5)
    neighbour_s = time.monotonic() - started
    group, topic = names.group("email", "marketing"), names.lane("email", "marketing")
    wait_until(lambda: committed_lag(fault_stack.bootstrap, group, topic) < 100, 60,
               "the committed lag to fall below the yield threshold", interval=1.0)

    assert metric(port, "dispatch_backpressure_pauses_total") in (None, 0.0)
    assert metric(port, "dispatch_spilled_total") > FLOOD * 0.9
    flooder = mock_provider.stats()["tenants"]["flooder"]["messages"]
    assert flooder <= 5 * (time.monotonic() - flood_started) + 5, flooder  # held to its own rate (+ burst)
    assert neighbour_s < 30


PUMP_PER_S, PUMP_S, PUMPER_RATE = 16, 25, 2


def test_a_transactional_tenant_sending_above_its_rate_does_not_hold_the_lanes_lag_over_the_yield_threshold(
        fault_stack, fault_runtime, fault_topics, fault_processes, mock_provider, names):
    """Given one transactional partition and tenant "pumper" limited to 2 OTPs a second (burst 2),
    When it publishes 16 OTPs a second for 25 s (an SMS-pumping attack, say) to a transactional worker and retrier,
    Then from the 12th second on (past what a ten-second share would hold) the lane's committed lag stays below the
    yield threshold (100 messages), so other tenants' marketing goes on, and the pumper is held to its own rate.
    Held ten seconds of its rate, the pumper pinned the committed offset ten seconds back: 160 messages of lag."""
    fault_topics("email", lane_partitions=1)
    mock_provider.reset(rate=1000)
    limits = fault_runtime.limit_store()
    limits.set_provider("resend", 1000, 1000)
    limits.set_tenant("resend", "*", 10_000, 100)
    limits.set_tenant("resend", "pumper", PUMPER_RATE, PUMPER_RATE)
    port = free_port()
    fault_processes.worker("email", "transactional", "--metrics-port", str(port))
    fault_processes.retrier("email", "transactional")
    client = fault_runtime.send_client()
    group, topic = names.group("email", "transactional"), names.lane("email", "transactional")

    started, lags = time.monotonic(), []
    for second in range(PUMP_S):
        client.publish_batch("pumper", [email_request("transactional")] * PUMP_PER_S)
        if second >= 12:
            lags.append(committed_lag(fault_stack.bootstrap, group, topic))
        time.sleep(max(0.0, started + second + 1 - time.monotonic()))  # the pumper's pace, not a wait for us

    assert max(lags) < 100, lags
    assert metric(port, "dispatch_spilled_total") > 0
    pumped = mock_provider.stats()["tenants"]["pumper"]["messages"]
    assert pumped <= PUMPER_RATE * (time.monotonic() - started) + PUMPER_RATE, pumped
