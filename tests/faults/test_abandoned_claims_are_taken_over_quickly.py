"""A worker killed in the middle of a request: its claims are taken over as soon as it is known to be
gone (its lease lapses within seconds because nobody keeps it alive), not after a lease sized for the
longest request, and never while it might still be sending."""

import signal
import time

from tests.harness import email_request, report_outcome, wait_until

TAKEOVER_BOUND_S = 25  # a lease tied to liveness: 10 s, plus the new worker's start; the old lease was 30 s


def test_a_killed_workers_requests_are_taken_over_within_seconds(
        fault_stack, fault_runtime, fault_topics, fault_processes, mock_provider):
    """Given a marketing worker with a 10 s provider timeout (a lease sized for the longest request would be
    30 s) whose provider has accepted its requests and holds the answers,
    When the worker is killed with kill -9 and a new worker starts,
    Then the new worker re-sends the abandoned requests under their own keys (answered from the provider's
    store) within 25 s of the kill, and each send is delivered exactly once."""
    fault_topics("email", lane_partitions=1)
    fault_processes.env["PROVIDER_TIMEOUT_S"] = "10"
    mock_provider.reset(rate=100)
    limits = fault_runtime.limit_store()
    limits.set_provider("resend", 100, 100)
    limits.set_tenant("resend", "*", 1000, 100)
    fault_processes.start("lag-monitor", "lag-monitor", ready="lag monitor publishing")
    mock_provider.configure(hold_answers=True)
    first = fault_processes.worker("email", "marketing")
    ids = fault_runtime.send_client().publish_batch("blaster", [email_request("marketing")] * 300)
    wait_until(lambda: mock_provider.stats()["held"] >= 3, 30, "the provider to hold three accepted batches")

    first.send_signal(signal.SIGKILL)
    first.wait(10)
    killed_at = time.monotonic()
    mock_provider.configure(hold_answers=False)
    fault_processes.worker("email", "marketing")
    wait_until(lambda: mock_provider.stats()["idempotent_replays"] >= 3,  # the bound counts from the kill
               TAKEOVER_BOUND_S - (time.monotonic() - killed_at), "the abandoned requests to be taken over and re-sent",
               interval=0.2)
    taken_over_s = time.monotonic() - killed_at

    stats = mock_provider.stats(deliveries=True)
    report_outcome("worker killed mid-request", ids, stats, fault_processes.procs)
    assert set(ids) <= set(stats["deliveries"]) and stats["duplicate_deliveries"] == 0
    assert taken_over_s < TAKEOVER_BOUND_S
