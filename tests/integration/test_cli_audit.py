"""Every operator change made from the `streams` CLI is on the audit trail, as the API's are, and a record
the broker does not confirm never hides what was done."""

import subprocess
import sys
import time

import orjson
from confluent_kafka.admin import AdminClient

from streams.names import RedisKeys
from streams.state.audit import AuditLog, cli_actor
from streams.state.log import OperatorLog
from streams.webhooks.endpoints import EndpointStore
from streams.webhooks.lookups import system_resolver
from streams.webhooks.sealing import Sealer
from streams.webhooks.ssrf import UrlPolicy
from tests.harness import free_port, start_api, wait_until
from tests.integration.conftest import TEST_SECRET_KEYS


def _cli(env, *args):
    return subprocess.run([sys.executable, "-m", "streams.cli", *args], env=env, capture_output=True, text=True,
                          timeout=120)


def test_every_operator_change_from_the_cli_is_on_the_audit_trail(stack, names, channel_topics, dispatch_env):
    """Given a namespace with the webhook channel's topics,
    When an operator, from the CLI, creates a tenant's webhook endpoint (its URL carrying a token), disables it,
    reactivates it, rotates its secret and deletes it, then acknowledges a Redis data loss and runs a state
    recovery,
    Then each change is one entry on the audit trail, in order, by `cli:<user>@<host>`, with the state before
    and after (before: nothing was recorded for any of them); neither a signing secret nor the URL is in it."""
    channel_topics("webhook")
    started = int(time.time() * 1000)
    created = _cli(dispatch_env, "endpoints", "create", "--tenant", "acme", "--events", "*",
                   "--url", "http://127.0.0.1:9/hook?token=url-carried-token")
    assert created.returncode == 0, created.stderr
    endpoint = orjson.loads(created.stdout)
    endpoint_id, secret = endpoint["id"], endpoint["secret"]
    for action in ("disable", "reactivate", "rotate", "delete"):
        done = _cli(dispatch_env, "endpoints", action, endpoint_id, "--tenant", "acme",
                    *(["--yes"] if action == "delete" else []))
        assert done.returncode == 0, (action, done.stderr)
        if action == "rotate":
            rotated = done.stdout.strip()
    refused = _cli(dispatch_env, "state", "acknowledge-loss")  # a decision to accept duplicates: said, not assumed
    assert refused.returncode != 0 and "say --yes" in refused.stderr, refused.stderr
    for action in ("acknowledge-loss --yes", "recover"):
        done = _cli(dispatch_env, "state", *action.split())
        assert done.returncode == 0, (action, done.stderr)

    trail = list(AuditLog(stack.bootstrap, names.audit).read(started))
    assert [e["what"] for e in trail] == [f"endpoint/{endpoint_id}"] * 5 + ["state/acknowledge-loss", "state/recover"]
    assert {e["who"] for e in trail} == {cli_actor()}
    create, disable, reactivate, rotate, delete, acknowledged, recovered = trail
    assert create["before"] is None and create["after"]["enabled"] and create["after"]["tenant"] == "acme"
    assert disable["before"]["enabled"] and not disable["after"]["enabled"]
    assert reactivate["after"]["state"] == "active"
    assert rotate["after"]["secret"] == "rotated"
    assert delete["before"]["tenant"] == "acme" and delete["after"] is None
    assert acknowledged["after"]["epoch"] and recovered["after"]["events"] == 0
    shown = orjson.dumps(trail).decode()
    assert secret not in shown and rotated not in shown and "url-carried-token" not in shown


def test_a_state_recovery_that_fails_is_on_the_audit_trail_as_unfinished(stack, names, channel_topics, dispatch_env):
    """Given a Redis that does not answer,
    When an operator runs `streams state recover`,
    Then it fails, and the audit trail has the attempt as unfinished, with its error's kind (before: only a recovery
    that finished was recorded, though one stopped part-way may have restored operator state and marks)."""
    channel_topics("email")
    started = int(time.time() * 1000)
    done = _cli({**dispatch_env, "REDIS_URL": "redis://127.0.0.1:9/0"}, "state", "recover")
    assert done.returncode != 0
    [entry] = [e for e in AuditLog(stack.bootstrap, names.audit).read(started) if e["what"] == "state/recover"]
    assert entry["after"]["finished"] is False and entry["after"]["error"], entry
    assert entry["who"] == cli_actor()


def test_a_cli_change_the_audit_trail_does_not_confirm_still_shows_what_was_done(stack, names, channel_topics,
                                                                               dispatch_env):
    """Given an audit trail the broker cannot take records on (its topic is gone),
    When an operator creates a tenant's API key from the CLI,
    Then the key is created and printed (before: the command failed before printing it, so the key existed and
    nobody had it), and the command warns that the change was applied but is not on the audit trail, exiting 4
    (not 1: running it again would make a second key); the warning does not carry the key."""
    channel_topics("email")
    admin = AdminClient({"bootstrap.servers": stack.bootstrap})
    for f in admin.delete_topics([names.audit]).values():
        f.result()
    wait_until(lambda: names.audit not in admin.list_topics(timeout=10).topics, 30, "the audit topic to be gone")
    made = _cli(dispatch_env, "keys", "create", "--tenant", "acme", "--label", "cli-audit-test")
    assert made.returncode == 4, made.stderr
    token = made.stdout.strip()
    assert token and token not in made.stderr
    assert "was applied, but the audit trail did not confirm its record" in made.stderr
    listed = _cli(dispatch_env, "keys", "list", "--tenant", "acme")
    assert listed.returncode == 0 and "valid" in listed.stdout and "cli-audit-test" in listed.stdout, listed


OLD_KEY = "test-0:9Yk4s1fyl4hA6Jk2KxVQyWdJbO3LCoSSt8Xb5gBkQ4c="  # listed once, dropped since


def test_a_reseal_stopped_part_way_puts_what_it_re_sealed_on_the_audit_trail(stack, names, channel_topics,
                                                                           dispatch_env):
    """Given tenant aaa's endpoint sealed under key test-1, and tenant bbb's two endpoints: the first under test-1, the
    second under test-0, a key no longer listed,
    When an operator re-seals every tenant's endpoints under test-2 (aaa's, then bbb's in the order they were made),
    Then the command fails naming the missing key (exit 1) and says it stopped at bbb after re-sealing 2 endpoints,
    and the audit trail holds that change: aaa's endpoint and bbb's first moved to test-2 (before: nothing was
    recorded, and a later run recorded only what it re-sealed itself)."""
    channel_topics("webhook")
    started = int(time.time() * 1000)
    test_1 = dispatch_env["WEBHOOK_SECRET_KEYS"].split(",")[1]
    for tenant, keys in (("aaa", test_1), ("bbb", test_1), ("bbb", OLD_KEY)):
        made = _cli({**dispatch_env, "WEBHOOK_SECRET_KEYS": keys}, "endpoints", "create", "--tenant", tenant,
                    "--events", "*", "--url", "http://127.0.0.1:9/hook")
        assert made.returncode == 0, made.stderr

    resealed = _cli(dispatch_env, "endpoints", "reseal", "--tenant", "*")
    assert resealed.returncode == 1, resealed.stderr
    assert "test-0" in resealed.stderr and "list that key again" in resealed.stderr
    assert "stopped at tenant bbb: at least 2 endpoint(s) re-sealed under key 'test-2' before" in resealed.stderr

    trail = [e for e in AuditLog(stack.bootstrap, names.audit).read(started) if e["what"].endswith("/reseal")]
    assert [e["after"] for e in trail] == [{"key": "test-2", "endpoints_at_least": 2, "stopped_at_tenant": "bbb",
                                            "error": "UnsealError"}]



def _redis_only_store(redis_client, namespace, sealer=None):
    """Endpoints written to Redis without the operator log: as a process's endpoint view, which follows that log,
    sees an endpoint it has not read yet (the log is behind, or its follower stuck)."""
    return EndpointStore(redis_client, namespace, None, UrlPolicy(require_https=False, allow=frozenset({"127.0.0.1"})),
                         system_resolver, sealer)


def test_a_reseal_of_every_tenant_reaches_the_endpoints_redis_holds(stack, namespace, redis_client, channel_topics,
                                                                   dispatch_env):
    """Given tenant ccc's endpoint sealed under key test-1 in Redis, which the operator log has not shown yet,
    When an operator re-seals every tenant's endpoints under test-2,
    Then that endpoint is re-sealed: 1 endpoint of 1 tenant, its secret under test-2 (before: the tenants were
    listed from the endpoint view, and the run reported success with 0 of 0)."""
    channel_topics("webhook")
    test_1 = Sealer.parse(dispatch_env["WEBHOOK_SECRET_KEYS"].split(",")[1])
    ep, _ = _redis_only_store(redis_client, namespace, test_1).create("ccc", "http://127.0.0.1:9/hook", ["*"])

    resealed = _cli(dispatch_env, "endpoints", "reseal", "--tenant", "*")
    assert resealed.returncode == 0, resealed.stderr
    assert "1 endpoint(s) of 1 tenant(s) re-sealed under key 'test-2'" in resealed.stdout
    [secret] = _redis_only_store(redis_client, namespace).get("ccc", ep.id).secrets
    assert secret.value.startswith("sealed:v1:test-2:")


def _disabled_endpoint_and_no_attempts_topic(stack, names, redis_client, namespace, endpoint_id):
    """The endpoint disabled by a 410, and the webhook attempts topic (the endpoint-health app's input) gone: the
    broker refuses a reactivation's health reset."""
    store = EndpointStore(redis_client, namespace, OperatorLog(stack.bootstrap, names.operator),
                          UrlPolicy(require_https=False, allow=frozenset({"127.0.0.1"})), system_resolver)
    assert store.set_state("acme", endpoint_id, "disabled", "the receiver answered 410 Gone").state == "disabled"
    admin = AdminClient({"bootstrap.servers": stack.bootstrap})
    for f in admin.delete_topics([names.webhook_attempts]).values():
        f.result()
    wait_until(lambda: names.webhook_attempts not in admin.list_topics(timeout=10).topics, 30,
               "the attempts topic to be gone")
    return store


def test_a_reactivation_whose_health_reset_is_refused_is_on_the_audit_trail(stack, names, namespace, redis_client,
                                                                            channel_topics, dispatch_env):
    """Given a tenant's endpoint disabled by a 410, and the broker refusing the reactivation's health reset (the
    webhook attempts topic is gone),
    When an operator reactivates it from the CLI,
    Then the command fails naming that topic (exit 1) and says the endpoint's configured state is active again but
    its reset was not confirmed, to reactivate it again, the endpoint is active in Redis (deliveries resume), and the audit trail holds that change,
    disabled -> active, with the error and without the URL (before: nothing was recorded; only a later run that
    succeeded was)."""
    channel_topics("webhook")
    started = int(time.time() * 1000)
    made = _cli(dispatch_env, "endpoints", "create", "--tenant", "acme", "--events", "*",
                "--url", "http://127.0.0.1:9/hook?token=url-carried-token")
    assert made.returncode == 0, made.stderr
    endpoint_id = orjson.loads(made.stdout)["id"]
    store = _disabled_endpoint_and_no_attempts_topic(stack, names, redis_client, namespace, endpoint_id)

    done = _cli(dispatch_env, "endpoints", "reactivate", endpoint_id, "--tenant", "acme")
    assert done.returncode == 1, done.stderr
    assert names.webhook_attempts in done.stderr
    assert (f"endpoint/{endpoint_id}: the endpoint's configured state is active again, but the message broker did not "
            "confirm its health reset (failure counter, alert window); it is active now: reactivate it again to "
            "finish") in done.stderr
    assert store.get("acme", endpoint_id).state == "active"

    trail = [e for e in AuditLog(stack.bootstrap, names.audit).read(started) if e["what"] == f"endpoint/{endpoint_id}"]
    assert len(trail) == 2, trail  # its creation, then the reactivation
    reactivated = trail[1]
    assert reactivated["before"]["state"] == "disabled" and reactivated["after"]["state"] == "active"
    assert reactivated["after"]["error"] in ("PublishError", "PublishOutcomeUnknown")
    assert "url-carried-token" not in orjson.dumps(reactivated).decode()


def test_an_operator_api_reactivation_whose_health_reset_is_refused_is_on_the_audit_trail(
        stack, names, namespace, redis_client, channel_topics, processes):
    """Given a tenant's endpoint disabled by a 410, and the broker refusing the reactivation's health reset,
    When an operator reactivates it through the operator API,
    Then the answer is 503 `"outcome": "applied"` saying the endpoint is active again and to reactivate it again to
    finish, the endpoint is active in Redis, and the audit trail holds disabled -> active with the error (before:
    a bare 503 and no record); the tenant's own reactivation is answered the same way."""
    channel_topics("webhook")
    api = start_api(processes, free_port(), {"a": "acme"}, redis_client, namespace)
    started = int(time.time() * 1000)
    r = api.post("/v1/endpoints", json={"url": "http://127.0.0.1:9/hook", "event_types": ["*"]}, headers=api.keys["a"])
    assert r.status_code == 201, r.text
    endpoint_id = r.json()["id"]
    store = _disabled_endpoint_and_no_attempts_topic(stack, names, redis_client, namespace, endpoint_id)
    wait_until(lambda: api.get(f"/v1/endpoints/{endpoint_id}", headers=api.keys["a"]).json()["state"] == "disabled",
               30, "the API's view of the endpoint to say disabled")

    # The broker's refusal of a topic it does not have comes after librdkafka's metadata wait (about 30 s).
    r = api.post(f"/v1/admin/endpoints/{endpoint_id}/reactivate", headers=api.keys["operator"], timeout=120)
    assert r.status_code == 503, r.text
    assert r.json()["outcome"] == "applied" and "reactivate it again to finish" in r.text
    assert store.get("acme", endpoint_id).state == "active"

    trail = [e for e in AuditLog(stack.bootstrap, names.audit).read(started) if e["what"] == f"endpoint/{endpoint_id}"]
    reactivated = trail[-1]  # the tenant's own creation of it is not an operator change
    assert reactivated["who"].startswith("key:") and reactivated["before"] == {"state": "disabled"}
    assert reactivated["after"]["state"] == "active"
    assert reactivated["after"]["error"] in ("PublishError", "PublishOutcomeUnknown")

    # The tenant's own reactivation (not an operator change: not audited) answers the same way.
    r = api.post(f"/v1/endpoints/{endpoint_id}/reactivate", headers=api.keys["a"], timeout=120)
    assert r.status_code == 503 and r.json()["outcome"] == "applied", r.text
    assert "reactivate it again to finish" in r.text



def test_the_operator_api_reactivates_an_endpoint_created_a_moment_before(stack, names, namespace, redis_client,
                                                                        channel_topics, processes):
    """Given a tenant's endpoint, created and disabled by a 410 right before (the API process's endpoint view may
    not have read either yet),
    When an operator reactivates it through the operator API at once,
    Then it is reactivated: 200 with the endpoint active, active in Redis, and the audit trail holds
    disabled -> active (before: 404 whenever the view had not read its creation yet); an unknown id is 404."""
    channel_topics("webhook")
    api = start_api(processes, free_port(), {"a": "acme"}, redis_client, namespace)
    store = EndpointStore(redis_client, namespace, OperatorLog(stack.bootstrap, names.operator),
                          UrlPolicy(require_https=False, allow=frozenset({"127.0.0.1"})), system_resolver)
    ep, _ = store.create("acme", "http://127.0.0.1:9/hook", ["*"])
    assert store.set_state("acme", ep.id, "disabled", "the receiver answered 410 Gone").state == "disabled"
    started = int(time.time() * 1000)

    r = api.post(f"/v1/admin/endpoints/{ep.id}/reactivate", headers=api.keys["operator"])
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "active" and r.json()["id"] == ep.id
    assert store.get("acme", ep.id).state == "active"
    [reactivated] = [e for e in AuditLog(stack.bootstrap, names.audit).read(started) if e["what"] == f"endpoint/{ep.id}"]
    assert reactivated["before"] == {"state": "disabled"} and reactivated["after"] == {"state": "active"}
    assert api.post("/v1/admin/endpoints/ep_nobody_has/reactivate", headers=api.keys["operator"]).status_code == 404


def test_an_endpoint_created_from_a_shell_without_the_sealing_keys_is_refused_unless_asked_unsealed(
        stack, names, namespace, channel_topics, dispatch_env, redis_client):
    """Given an operator's shell without WEBHOOK_SECRET_KEYS (the API and the workers have them),
    When it creates a webhook endpoint, then does so with --unsealed (and, with the keys, one for "acme corp"),
    Then the first is refused naming the variable, and nothing is stored (before: the secret was stored in the clear,
    in Redis and in the operator log, without a word); the second is created, and an operator's `endpoints show`
    says it is in the clear, and names the key that seals one created with the keys (the runbook's check); "acme
    corp", which no tenant id can be, is refused."""
    channel_topics("webhook")
    shell = {k: v for k, v in dispatch_env.items() if k != "WEBHOOK_SECRET_KEYS"}
    mistyped = _cli(dispatch_env, "endpoints", "create", "--tenant", "acme corp", "--events", "*", "--url",
                    "http://127.0.0.1:9/h")  # no tenant id has a space: an endpoint no event could ever reach
    assert mistyped.returncode != 0 and "'acme corp' is not a tenant id" in mistyped.stderr, mistyped.stderr
    refused = _cli(shell, "endpoints", "create", "--tenant", "acme", "--events", "*", "--url", "http://127.0.0.1:9/h")
    assert refused.returncode != 0 and "WEBHOOK_SECRET_KEYS" in refused.stderr, refused.stderr
    assert "nothing was changed" in refused.stderr
    assert not redis_client.exists(RedisKeys(namespace).endpoints("acme"))
    made = _cli(shell, "endpoints", "create", "--tenant", "acme", "--events", "*", "--url", "http://127.0.0.1:9/h",
                "--unsealed")
    assert made.returncode == 0, made.stderr
    unsealed = orjson.loads(made.stdout)
    assert unsealed["secret"].startswith("whsec_")
    sealed = orjson.loads(_cli(dispatch_env, "endpoints", "create", "--tenant", "acme", "--events", "*", "--url",
                               "http://127.0.0.1:9/h").stdout)
    # An operator's look says which key seals each secret (what WebhookSecretsUnreadable compares), never a secret.
    key_id = TEST_SECRET_KEYS.split(",")[0].split(":")[0]
    for endpoint, sealed_with in ((unsealed, "(in the clear)"), (sealed, key_id)):
        shown = _cli(dispatch_env, "endpoints", "show", endpoint["id"], "--tenant", "acme")
        assert shown.returncode == 0, shown.stderr
        assert orjson.loads(shown.stdout)["secrets"] == [{"sealed_with": sealed_with, "expires_at_ms": None}]
        assert endpoint["secret"] not in shown.stdout
