"""Redis stopped for 10 s in the middle of a blast: the workers hold (fail closed), stay alive, and
resume by themselves when Redis is back; nothing is lost, nothing is sent twice, and the committed
offsets reach the end of the lanes."""

import time

from tests.harness import committed_lag, email_request, free_port, metric, report_outcome, wait_until

BLAST = 3_000
OTPS = 200
OUTAGE_S = 10


def test_redis_outage_mid_blast_holds_then_resumes_without_loss_or_duplicates(
        fault_stack, fault_runtime, fault_topics, fault_processes, mock_provider, names):
    """Given a 3,000-email marketing blast and 200 OTPs on a private stack, with both lane workers, both
    retriers and the outcome recorder running,
    When Redis is stopped for 10 s once a fifth of the blast is delivered, then started again,
    Then every worker says it is holding (dispatch_dependency_down = 1) during the outage and not afterwards,
    every process is still alive, every send is delivered exactly once, and both lanes' committed offsets
    reach the end."""
    fault_topics("email")
    mock_provider.reset(rate=100, latency_ms=20)
    limits = fault_runtime.limit_store()
    limits.set_provider("resend", 100, 100, reserve=5)
    limits.set_tenant("resend", "*", 100_000, 100)
    ports = {"marketing": free_port(), "transactional": free_port()}
    for lane, port in ports.items():
        fault_processes.worker("email", lane, "--metrics-port", str(port))
        fault_processes.retrier("email", lane)
    fault_processes.start("lag-monitor", "lag-monitor", ready="lag monitor publishing")
    fault_processes.start("outcome-recorder", "outcome-recorder", ready="outcome recorder consuming")
    client = fault_runtime.send_client()
    ids = []
    for _ in range(BLAST // 500):
        ids += client.publish_batch("blaster", [email_request("marketing")] * 500)
    wait_until(lambda: mock_provider.stats()["messages_delivered"] >= BLAST // 5, 60, "a fifth of the blast")

    fault_stack.stop_redis()
    stopped_at = time.monotonic()
    ids += [client.publish("shop", email_request("transactional")) for _ in range(OTPS)]
    for port in ports.values():
        wait_until(lambda port=port: metric(port, "dispatch_dependency_down", dependency="redis") == 1, 20,
                   "the worker to report that it holds for Redis")
    time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - stopped_at)))  # the outage lasts 10 s by definition
    fault_stack.start_redis()

    for lane in ("marketing", "transactional"):
        wait_until(lambda lane=lane: committed_lag(fault_stack.bootstrap, names.group("email", lane),
                                                   names.lane("email", lane)) == 0, 120,
                   f"the {lane} lane to be committed to its end", interval=0.5)
    stats = mock_provider.stats(deliveries=True)
    report_outcome("Redis stopped 10 s mid-blast", ids, stats, fault_processes.procs)
    assert set(ids) <= set(stats["deliveries"]), "a send was lost"
    assert stats["duplicate_deliveries"] == 0, stats["duplicated_sends"]
    for port in ports.values():
        assert metric(port, "dispatch_dependency_down", dependency="redis") == 0
    dead = [name for name, proc, _ in fault_processes.procs if proc.poll() is not None]
    assert dead == [], f"processes died: {dead}"
