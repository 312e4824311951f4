"""The broker stopped for 40 s in the middle of a blast, with every role running: no process dies,
nothing is lost or sent twice, and nobody restarts anything by hand.

It covers three promises at once: every role survives a broker outage by itself (no librdkafka
call that can abort the process during an outage); a record the broker does not acknowledge
within the (here lowered) delivery timeout is produced again until it is, with its offset kept
unstored meanwhile; and the lag monitor counts as published only what the broker acknowledged, so
it goes stale, visibly, while the broker is away.
"""

import time

import httpx

from tests.harness import (
    answers,
    committed_lag,
    email_request,
    free_port,
    local_client,
    metric,
    report_outcome,
    wait_until,
)

BLAST = 4_000
OUTAGE_S = 40


def test_broker_outage_mid_blast_every_role_survives_nothing_lost_or_doubled(
        fault_stack, fault_runtime, fault_topics, fault_processes, mock_provider, names):
    """Given a 4,000-email blast on a private stack with both lane workers, both retriers, the lag monitor,
    the outcome recorder and the ingest API running, and a delivery timeout lowered to 5 s,
    When the broker is stopped for 40 s once a fifth of the blast is delivered, then started again,
    Then the lag monitor's last acknowledged publication stops advancing during the outage, the workers
    produce unacknowledged outcome records again (dispatch_produce_retries_total > 0), every process is alive
    at the end, the API accepts a send again, every send is delivered exactly once and both lanes are
    committed to their end."""
    fault_topics("email")
    fault_processes.env["KAFKA_DELIVERY_TIMEOUT_MS"] = "5000"
    # 4 requests of 50 a second: the blast takes ~20 s, so the broker goes away in the middle of it.
    mock_provider.reset(rate=4, latency_ms=50)
    limits = fault_runtime.limit_store()
    limits.set_provider("resend", 4, 4, reserve=1)
    limits.set_tenant("resend", "*", 100_000, 50)
    api_key = fault_runtime.api_keys().create("tenant", "shop")
    worker_ports = {"marketing": free_port(), "transactional": free_port()}
    monitor_port, api_port = free_port(), free_port()
    for lane, port in worker_ports.items():
        fault_processes.worker("email", lane, "--metrics-port", str(port))
        fault_processes.retrier("email", lane)
    fault_processes.start("lag-monitor", "lag-monitor", "--metrics-port", str(monitor_port),
                          ready="lag monitor publishing")
    fault_processes.start("outcome-recorder", "outcome-recorder", ready="outcome recorder consuming")
    fault_processes.start("api", "api", "--port", str(api_port))
    api = local_client(base_url=f"http://127.0.0.1:{api_port}", timeout=30,
                       headers={"Authorization": f"Bearer {api_key}"})
    wait_until(lambda: answers(api), 30, "the ingest API")
    client = fault_runtime.send_client()
    ids = []
    for _ in range(BLAST // 1000):
        ids += client.publish_batch("blaster", [email_request("marketing")] * 1000)
    ids += client.publish_batch("shop", [email_request("transactional")] * 50)
    wait_until(lambda: mock_provider.stats()["messages_delivered"] >= BLAST // 5, 60, "a fifth of the blast")

    fault_stack.stop_kafka()
    stopped_at = time.monotonic()
    assert mock_provider.stats()["messages_delivered"] < BLAST, "the blast was over before the broker stopped"
    wait_until(lambda: time.time() - metric(monitor_port, "dispatch_lag_monitor_last_publish_timestamp_seconds", channel="email")
               > 10, 30, "the lag monitor to go stale while the broker is away", interval=0.5)
    time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - stopped_at)))  # the outage lasts 40 s by definition
    fault_stack.start_kafka()

    wait_until(lambda: time.time() - metric(monitor_port, "dispatch_lag_monitor_last_publish_timestamp_seconds", channel="email")
               < 5, 60, "the lag monitor to publish again", interval=0.5)
    response = wait_until(lambda: _post(api), 60, "the API to accept a send again", interval=1.0)
    ids.append(response.json()["send_id"])
    for lane in ("marketing", "transactional"):
        wait_until(lambda lane=lane: committed_lag(fault_stack.bootstrap, names.group("email", lane),
                                                   names.lane("email", lane)) == 0, 180,
                   f"the {lane} lane to be committed to its end", interval=1.0)
    stats = mock_provider.stats(deliveries=True)
    report_outcome("broker stopped 40 s mid-blast", ids, stats, fault_processes.procs)
    assert set(ids) <= set(stats["deliveries"]), f"{len(set(ids) - set(stats['deliveries']))} sends lost"
    assert stats["duplicate_deliveries"] == 0, stats["duplicated_sends"]
    assert sum(metric(p, "dispatch_produce_retries_total") or 0 for p in worker_ports.values()) > 0
    dead = [name for name, proc, _ in fault_processes.procs if proc.poll() is not None]
    assert dead == [], f"processes died: {dead}"


def _post(api: httpx.Client):
    try:
        r = api.post("/v1/sends", json=email_request())
    except httpx.TransportError:
        return None
    return r if r.status_code == 202 else None
