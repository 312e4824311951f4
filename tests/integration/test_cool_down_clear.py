"""A provider-wide cool-down (a 429's Retry-After, up to a day for a quota) holds every worker; an operator whose
provider takes requests again (its quota was raised) ends it from the CLI, and the workers send within seconds."""

import subprocess
import sys
import time

from streams.gate.gate import RedisGate
from streams.state.audit import AuditLog
from tests.harness import email_request, free_port, metric, wait_until


def _cli(env, *args):
    return subprocess.run([sys.executable, "-m", "streams.cli", *args], env=env, capture_output=True, text=True,
                          timeout=120)


def test_an_operator_ends_a_long_cool_down_and_the_workers_send_within_seconds(
        stack, names, channel_topics, limits, processes, send_client, mock_provider, redis_client, namespace,
        dispatch_env):
    """Given a transactional email worker held by an hour's cool-down of resend (a quota 429 another worker saw),
    When an operator sees it (`streams limits show`) and ends it (`streams limits clear-cooldown`),
    Then the held send reaches the provider within 20 s of the command, and the change is on the audit trail
    (before, nothing could end it: every worker held for the whole hour, asking nothing in between)."""
    channel_topics("email")
    started_ms = int(time.time() * 1000)
    mock_provider.reset(rate=50)
    limits.set_provider("resend", 50, 50)
    limits.set_tenant("resend", "*", 1000, 100)
    RedisGate(redis_client, namespace).cool_down("resend", 3600)
    port = free_port()
    processes.worker("email", "transactional", "--metrics-port", str(port))
    [send_id] = send_client.publish_batch("shop", [email_request()])
    wait_until(lambda: (metric(port, "dispatch_gate_denials_total", provider="resend", lane="transactional",
                               bucket="cooldown") or 0) >= 1, 30, "the worker to be held by the cool-down")

    shown = _cli(dispatch_env, "limits", "show", "--provider", "resend")
    assert shown.returncode == 0, shown.stderr
    [left] = [float(line.split("=")[1].split()[0]) for line in shown.stdout.splitlines() if "cool_down_left_s" in line]
    assert 3000 < left <= 3600
    cleared = _cli(dispatch_env, "limits", "clear-cooldown", "--provider", "resend")
    assert cleared.returncode == 0 and "resend: cool-down ended" in cleared.stdout, cleared.stdout + cleared.stderr
    ended = time.monotonic()
    wait_until(lambda: send_id in mock_provider.stats(deliveries=True)["deliveries"], 20,
               "the held send to reach the provider", interval=0.2)
    print(f"sent {time.monotonic() - ended:.1f} s after the cool-down was ended")

    [entry] = [e for e in AuditLog(stack.bootstrap, names.audit).read(started_ms) if e["what"] == "cooldown/resend"]
    assert entry["before"]["cool_down_left_s"] > 3000 and entry["after"] == {"cool_down_left_s": 0}
    again = _cli(dispatch_env, "limits", "clear-cooldown", "--provider", "resend")
    assert again.returncode == 0 and "resend: no cool-down" in again.stdout


def test_an_operator_sees_and_ends_the_cool_down_of_a_tenants_own_account(stack, names, channel_topics, redis_client,
                                                                         namespace, dispatch_env):
    """Given a day's cool-down of tenant own's account at resend (a quota 429 of the account it sends under),
    When an operator shows resend's limits for own and ends that cool-down (`--tenant own`),
    Then the show says what is left of own's account's hold, the end says what was left, and the audit trail has
    it under `cooldown/resend/own` (before: only the shared account's hold could be seen or ended)."""
    channel_topics("email")  # with the audit topic
    started_ms = int(time.time() * 1000)
    RedisGate(redis_client, namespace, own_account=lambda provider, tenant: tenant == "own").cool_down(
        "resend", 86400, tenant="own")
    shown = _cli(dispatch_env, "limits", "show", "--provider", "resend", "--tenant", "own")
    assert shown.returncode == 0, shown.stderr
    [left] = [float(line.split("=")[1].split()[0]) for line in shown.stdout.splitlines()
              if "own_account_hold_s" in line]
    assert 86000 < left <= 86400
    cleared = _cli(dispatch_env, "limits", "clear-cooldown", "--provider", "resend", "--tenant", "own")
    assert cleared.returncode == 0, cleared.stdout + cleared.stderr
    assert "resend (tenant own's own account): cool-down ended" in cleared.stdout
    [entry] = [e for e in AuditLog(stack.bootstrap, names.audit).read(started_ms) if e["what"] == "cooldown/resend/own"]
    assert entry["before"]["cool_down_left_s"] > 86000 and entry["after"] == {"cool_down_left_s": 0}


def test_a_tenant_with_its_own_provider_account_is_not_held_by_the_shared_accounts_cool_down(
        channel_topics, limits, processes, send_client, mock_provider, redis_client, namespace):
    """Given a transactional email worker whose tenant `own` sends under a Resend key (an account) of its own, and an
    hour's cool-down of the shared account (a 429 another tenant's request met),
    When `own` and `shared` each publish a send,
    Then `own`'s reaches the provider while `shared`'s is held by the cool-down (before, the gate held every tenant
    on the shared account's cool-down, although the README says a tenant's own account is held alone on its 429s)."""
    channel_topics("email")
    mock_provider.reset(rate=50)
    limits.set_provider("resend", 50, 50)
    limits.set_tenant("resend", "*", 1000, 100)
    RedisGate(redis_client, namespace).cool_down("resend", 3600)
    port = free_port()
    processes.worker("email", "transactional", "--metrics-port", str(port),
                     env={"RESEND_API_KEYS": '{"*": "re_test_default", "own": "re_test_own_account"}'})
    [shared] = send_client.publish_batch("shared", [email_request()])
    [own] = send_client.publish_batch("own", [email_request()])
    wait_until(lambda: own in mock_provider.stats(deliveries=True)["deliveries"], 30,
               "the own-account tenant's send to reach the provider", interval=0.2)
    wait_until(lambda: (metric(port, "dispatch_gate_denials_total", provider="resend", lane="transactional",
                               bucket="cooldown") or 0) >= 1, 30, "the shared tenant to be held by the cool-down")
    assert shared not in mock_provider.stats(deliveries=True)["deliveries"]
