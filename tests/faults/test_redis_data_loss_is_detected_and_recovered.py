"""Redis loses its data mid-blast (`SHUTDOWN NOSAVE`, an empty Redis in its place): the limits and API
keys come back by themselves from the operator log, dispatch holds (fails closed, says so) instead of
re-sending everything, and after `streams state recover` the blast completes with nothing lost and
nothing sent twice, even for a worker restarted during the hold that reads uncommitted work again."""

import re
import signal
import subprocess
import sys
import time

import httpx

from streams.ingest.status import StatusStore
from streams.send import new_send_id
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

BLAST = 3_000
HOLD_S = 3


def test_lost_redis_data_restores_operator_state_holds_dispatch_and_recovers_without_duplicates(
        fault_stack, fault_env, fault_runtime, fault_topics, fault_processes, mock_provider, names):
    """Given limits and an API key set through the operator tools, a 3,000-email blast under way with a
    marketing worker, the ingest API and the outcome recorder,
    When Redis shuts down without saving and comes back empty,
    Then the limits and the API key are back in Redis without anyone acting, the API accepts the old key,
    the worker reports the loss (dispatch_redis_state_lost = 1) and sends nothing while it holds, even after
    it is killed and restarted, and the API replays no dead letter (503, one whose status went with the data too: it was 404 "no send"); and when an operator runs `streams state recover`, dispatch resumes and every
    send is delivered exactly once."""
    fault_topics("email")
    mock_provider.reset(rate=50, latency_ms=20)
    limits = fault_runtime.limit_store()
    limits.set_provider("resend", 50, 50)
    limits.set_tenant("resend", "*", 100_000, 50)
    before = limits.show("resend")
    api_key = fault_runtime.api_keys().create("tenant", "blaster")
    operator_key = fault_runtime.api_keys().create("operator", None)
    port, api_port = free_port(), free_port()
    fault_processes.worker("email", "marketing", "--metrics-port", str(port))
    fault_processes.start("outcome-recorder", "outcome-recorder", ready="outcome recorder consuming")
    fault_processes.start("lag-monitor", "lag-monitor", ready="lag monitor publishing")
    fault_processes.start("api", "api", "--port", str(api_port))
    api = local_client(base_url=f"http://127.0.0.1:{api_port}", timeout=10,
                       headers={"Authorization": f"Bearer {api_key}"})
    wait_until(lambda: answers(api), 30, "the ingest API")
    client = fault_runtime.send_client()
    ids = []
    for _ in range(BLAST // 500):
        ids += client.publish_batch("blaster", [email_request("marketing")] * 500)
    wait_until(lambda: mock_provider.stats()["messages_delivered"] >= BLAST // 3, 60, "a third of the blast")

    lost_letter = {"send_id": new_send_id(), "tenant_id": "blaster", "channel": "email", "lane": "marketing",
                   "status": "dead_lettered", "reason": "retries_exhausted", "completed_at_ms": int(time.time() * 1e3)}
    StatusStore(fault_runtime.redis(), fault_runtime.namespace).record_outcome(lost_letter)
    fault_stack.lose_redis_data()

    wait_until(lambda: metric(port, "dispatch_redis_state_lost") == 1, 30, "the worker to report the loss")
    wait_until(lambda: limits.show("resend") == before, 30, "the limits to come back from the operator log")
    accepted = wait_until(lambda: _post(api), 30, "the API to accept the old key")
    ids.append(accepted.json()["send_id"])
    # A dead letter whose status `state recover` would rebuild before its replay mark: no replay is claimed
    # while the data is lost (one asked in between would replay a send replayed before the loss again).
    dead_letter = {"send_id": new_send_id(), "tenant_id": "blaster", "channel": "email", "lane": "marketing",
                   "status": "dead_lettered", "reason": "retries_exhausted", "completed_at_ms": int(time.time() * 1e3)}
    StatusStore(fault_runtime.redis(), fault_runtime.namespace).record_outcome(dead_letter)
    operator = local_client(base_url=f"http://127.0.0.1:{api_port}", timeout=10,
                            headers={"Authorization": f"Bearer {operator_key}"})
    refused = operator.post(f"/v1/admin/dlq/{dead_letter['send_id']}/replay")
    assert refused.status_code == 503, refused.text
    # One whose status went with the data: 503 for the loss too, not 404 "no send" (it exists, and comes back).
    refused = operator.post(f"/v1/admin/dlq/{lost_letter['send_id']}/replay")
    assert refused.status_code == 503 and "lost its data" in refused.text, refused.text
    held_at = mock_provider.stats()["messages_delivered"]
    # A worker restarted during the hold reads uncommitted work again: it must hold too.
    fault_processes.procs[0][1].send_signal(signal.SIGKILL)
    fault_processes.procs[0][1].wait(10)
    restarted = free_port()
    fault_processes.worker("email", "marketing", "--metrics-port", str(restarted))
    wait_until(lambda: metric(restarted, "dispatch_redis_state_lost") == 1, 30, "the new worker to hold")
    time.sleep(HOLD_S)  # the hold lasts this long before the operator acts, by definition of the scenario
    assert mock_provider.stats()["messages_delivered"] == held_at, "sends went out while Redis's data was lost"
    assert held_at < BLAST

    out = subprocess.run([sys.executable, "-m", "streams.cli", "state", "recover"], env=fault_env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "dispatch resumes" in out.stdout
    # Each delivered send's mark came back from its outcome event (a batch's events share one record): at
    # most the requests in flight at the loss (8 of 100) had no outcome written yet.
    marks = int(re.search(r"(\d+) delivered marks", out.stdout).group(1))
    assert marks >= held_at - 800, out.stdout

    wait_until(lambda: metric(restarted, "dispatch_redis_state_lost") == 0, 30, "dispatch to resume")
    wait_until(lambda: committed_lag(fault_stack.bootstrap, names.group("email", "marketing"),
                                     names.lane("email", "marketing")) == 0, 120, "the blast to complete",
               interval=0.5)
    stats = mock_provider.stats(deliveries=True)
    report_outcome("Redis data lost (shutdown nosave) mid-blast", ids, stats, fault_processes.procs)
    assert set(ids) <= set(stats["deliveries"]), "a send was lost"
    assert stats["duplicate_deliveries"] == 0, stats["duplicated_sends"]
    for send_id in (ids[0], ids[BLAST // 2], ids[BLAST - 1]):  # statuses recorded from the batched records
        wait_until(lambda s=send_id: api.get(f"/v1/sends/{s}").json().get("status") == "delivered", 60,
                   f"send {send_id} to read delivered")


def _post(api: httpx.Client):
    """The response when the API accepted the send; else what it answered, for the failure message."""
    try:
        r = api.post("/v1/sends", json=email_request("marketing"))
    except httpx.TransportError as exc:
        return _Refused(repr(exc))
    return r if r.status_code == 202 else _Refused(f"{r.status_code} {r.text[:300]}")


class _Refused(str):
    def __bool__(self) -> bool:
        return False
