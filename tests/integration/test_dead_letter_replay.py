"""A send that keeps failing ends in notif.dlq after exactly its policy's attempts; replay delivers it."""

import subprocess
import sys

from streams.retry.dlq import read_all
from tests.harness import sms_request, wait_until

POLICIES = """
[policy.transactional]
max_attempts = 3
max_age = "1h"
schedule = ["10s"]

[policy.marketing]
max_attempts = 3
max_age = "1h"
schedule = ["10s"]
"""


def test_exhausted_send_is_dead_lettered_then_replayed(stack, names, channel_topics, limits, processes,
                                                      send_client, mock_provider, tmp_path, dispatch_env):
    """Given retry policies allowing 3 attempts with a 10 s tier, a transactional SMS worker and its retrier, and a
    provider that answers 500 to everything,
    When one SMS send is published, and after it is dead-lettered the provider recovers and an operator runs `dlq
    replay` on it,
    Then the send lands once in notif.dlq after exactly 3 attempts (reason retries_exhausted, with its send id, tenant,
    channel and the last 500 error), the replay delivers it exactly once, `dlq show` shows the reason without revealing
    the phone number, and replaying an unknown send id fails saying it is not in the DLQ."""
    channel_topics("sms")
    limits.set_provider("sms", 100, 100)
    limits.set_tenant("sms", "*", 100, 100)
    policy_file = tmp_path / "policies.toml"
    policy_file.write_text(POLICIES)
    processes.env["DUAL_RAIL_RETRY_POLICIES"] = str(policy_file)
    mock_provider.configure(fault_5xx_ratio=1.0)
    processes.worker("sms", "transactional")
    processes.retrier("sms", "transactional")

    send_id = send_client.publish("acme", sms_request())

    records = wait_until(lambda: read_all(stack.bootstrap, names.dlq, timeout_s=5), 60,
                         "the send to be dead-lettered")
    assert len(records) == 1
    r = records[0]
    assert r.key == send_id and r.headers["send_id"] == send_id
    assert r.reason == "retries_exhausted" and r.headers["attempts"] == "3"
    assert r.headers["tenant"] == "acme" and r.headers["channel"] == "sms"
    assert r.headers["last_error"].startswith("500 internal_server_error")
    assert mock_provider.stats()["faults_5xx"] == 3  # exactly the policy's attempts

    # When the provider recovers and an operator replays the dead letter
    mock_provider.configure(fault_5xx_ratio=0.0)
    env = {**dispatch_env, "DUAL_RAIL_RETRY_POLICIES": str(policy_file)}
    out = subprocess.run([sys.executable, "-m", "streams.cli", "dlq", "replay", send_id], env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    wait_until(lambda: send_id in mock_provider.stats(deliveries=True)["deliveries"], 30,
               "the replayed send to be delivered")
    assert mock_provider.stats()["duplicate_deliveries"] == 0

    shown = subprocess.run([sys.executable, "-m", "streams.cli", "dlq", "show", send_id], env=env,
                           capture_output=True, text=True)
    assert "retries_exhausted" in shown.stdout and "+14155550123" not in shown.stdout
    missing = subprocess.run([sys.executable, "-m", "streams.cli", "dlq", "replay", "no-such-send"], env=env,
                             capture_output=True, text=True)
    assert missing.returncode == 1 and "is not in the DLQ" in missing.stderr
