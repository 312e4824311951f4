"""The webhook channel end to end: endpoints registered by tenants, events fanned out to them, signed
at-least-once delivery on the seed schedule, attempt history, replay, SSRF rules, tenant isolation."""

import base64
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import orjson
import pytest
from confluent_kafka import Producer

from streams.errors import (
    BrokerUnavailable,
    PublishError,
    PublishOutcomeUnknown,
    ReplayNeedsCheck,
    ReplayOutcomeUnknown,
    ReplayRefused,
)
from streams.ingest.status import StatusStore
from streams.kafka_client import put_acked
from streams.lanes import RETRY_TIERS
from streams.names import RedisKeys
from streams.retry.replay import replay
from streams.runtime import Runtime
from streams.send import MAX_SEND_BYTES
from streams.state.log import OperatorLog
from streams.webhooks import delivery as delivery_module
from streams.webhooks.api import BulkReplayStopped, _stopped, next_since, replay_in_turn, replay_once
from streams.webhooks.client import WebhooksClient
from streams.webhooks.endpoints import EndpointStore
from streams.webhooks.lookups import system_resolver
from streams.webhooks.sealing import Sealer
from streams.webhooks.ssrf import UrlPolicy
from tests.harness import (
    committed_lag,
    committed_messages,
    email_request,
    free_port,
    read_committed,
    start_api,
    wait_until,
)
from tests.harness import delivery as _delivery
from tests.harness import final_delivery as _final
from tests.harness import register_endpoint as _register
from tests.harness import webhook_event as event
from tests.integration.conftest import TEST_SECRET_KEYS

SCALE = 0.0002  # the 9-attempt schedule (10 s ... 12 h, about 22 h) walked in about 16 s: same code path


@pytest.fixture
def hooks(stack, namespace, channel_topics, limits, processes, redis_client, mock_endpoint):
    """The webhook lane's topics, a worker, a retrier, the outcome recorder and the API for tenants a and b."""
    return _hooks(namespace, channel_topics, limits, processes, redis_client, SCALE)


def _hooks(namespace, channel_topics, limits, processes, redis_client, scale: float, worker: bool = True):
    channel_topics("webhook")
    limits.set_provider("webhook", 10_000, 10_000)
    limits.set_tenant("webhook", "*", 10_000, 1_000)
    processes.env["DUAL_RAIL_RETRY_TIME_SCALE"] = str(scale)
    if worker:
        _webhook_worker(processes)
    processes.retrier("webhook", "transactional")
    processes.start("outcome-recorder", "outcome-recorder", ready="outcome recorder consuming")
    api = start_api(processes, free_port(), {"a": "tenant-a", "b": "tenant-b"}, redis_client, namespace)
    api.store = StatusStore(redis_client, namespace)
    return api


def _webhook_worker(processes, name: str = "webhook-worker", env: dict | None = None):
    """A webhook worker; it delivers once its endpoint view has read the operator log to its end."""
    return processes.start(name, "worker", "--channel", "webhook", "--lane", "transactional", ready="consuming",
                           env=env)


def test_a_signed_event_reaches_every_subscribed_endpoint_and_its_history_is_kept(hooks, mock_endpoint):
    """Given tenant a with two endpoints subscribed to invoice.paid and one to order.shipped,
    When a publishes an invoice.paid event and an event nobody subscribes to,
    Then the first fans out to exactly the two subscribed endpoints (one delivery each, with their own ids), each
    arrives once with a signature the receiver verifies, and each delivery's history shows one 2xx attempt; the
    second is accepted with zero deliveries and says so."""
    one, two = _register(hooks, mock_endpoint, "one"), _register(hooks, mock_endpoint, "two")
    _register(hooks, mock_endpoint, "other", event_types=("order.shipped",))
    r = hooks.post("/v1/sends", json=event(), headers=hooks.keys["a"])
    assert r.status_code == 202, r.text
    deliveries = r.json()["deliveries"]
    assert sorted(d["endpoint_id"] for d in deliveries) == sorted([one["id"], two["id"]])
    for d in deliveries:
        done = _final(hooks, d["delivery_id"])
        assert done["status"] == "delivered" and done["event_id"] == r.json()["send_id"]
        [attempt] = done["attempt_history"]
        assert attempt["status_code"] == 200 and attempt["n"] == 1 and attempt["duration_ms"] >= 0
    stats = mock_endpoint.stats(deliveries=True)
    assert stats["invalid_signatures"] == 0
    assert sorted(stats["deliveries"]) == sorted(d["delivery_id"] for d in deliveries)

    nobody = hooks.post("/v1/sends", json=event("nobody.cares"), headers=hooks.keys["a"]).json()
    assert nobody["deliveries"] == [] and "no enabled endpoint" in nobody["note"]


def test_the_sdk_sends_an_event_again_under_its_idempotency_key_as_the_same_event(hooks, mock_endpoint):
    """Given an endpoint subscribed to invoice.paid, and the webhooks SDK,
    When a producer sends an event with an idempotency key, then again with the same key (its retry after a timeout),
    Then the second answer is the first (the same event and delivery ids) and the receiver gets one delivery (before:
    the SDK sent no key, so a retry was a second event, delivered again under a new webhook-id); without a key the
    same call is another event."""
    _register(hooks, mock_endpoint, "keyed")
    sdk = WebhooksClient(str(hooks.base_url), hooks.keys["a"]["Authorization"].removeprefix("Bearer "))
    try:
        first = sdk.send_event("invoice.paid", {"id": 7}, "2026-11-30T12:00:00Z", idempotency_key="invoice-7-paid")
        again = sdk.send_event("invoice.paid", {"id": 7}, "2026-11-30T12:00:00Z", idempotency_key="invoice-7-paid")
        other = sdk.send_event("invoice.paid", {"id": 7}, "2026-11-30T12:00:00Z")
    finally:
        sdk.http.close()
    assert (again["send_id"], again["deliveries"]) == (first["send_id"], first["deliveries"])
    assert other["send_id"] != first["send_id"]
    ids = [d["delivery_id"] for d in (*first["deliveries"], *other["deliveries"])]
    for delivery_id in ids:
        assert _final(hooks, delivery_id)["status"] == "delivered"
    assert sorted(mock_endpoint.stats(deliveries=True)["deliveries"]) == sorted(ids)


def test_an_oversized_event_in_a_batch_is_named_by_its_place_in_the_batch(hooks, mock_endpoint):
    """Given tenant a with two endpoints subscribed to invoice.paid (each event fans out to two deliveries),
    When a posts a batch of two events whose second is over the send limit,
    Then the 413 names `sends[1]`, the batch's own position (not 2, its first delivery's place among the four)."""
    for name in ("one", "two"):
        _register(hooks, mock_endpoint, name)
    big = event(blob="x" * (MAX_SEND_BYTES + 1024))
    r = hooks.post("/v1/sends/batch", json={"sends": [event(), big]}, headers=hooks.keys["a"])
    assert r.status_code == 413, r.text
    [error] = r.json()["errors"]
    assert error["loc"] == ["body", "sends", 1] and error["msg"].startswith("send 1 is "), error


def test_a_request_whose_events_fan_out_past_16_mib_is_refused_naming_the_event(hooks, mock_endpoint):
    """Given tenant a with 20 endpoints subscribed to invoice.paid,
    When a posts a batch of two 512 KiB events (20 MiB of payload once copied to each endpoint),
    Then it is refused 413 `fan_out_too_large` naming `sends[1]`, the event that passes the bound, and nothing is
    published (before: accepted, 40 records of 512 KiB built, twice, and held in the process while the batch
    waited its turn: 50 endpoints made a 5 MiB batch 250 MiB); one such event alone is accepted."""
    for i in range(20):
        _register(hooks, mock_endpoint, f"ep-{i}")
    big = event(blob="x" * (512 * 1024))
    r = hooks.post("/v1/sends/batch", json={"sends": [big, big]}, headers=hooks.keys["a"])
    assert r.status_code == 413, r.text
    [error] = r.json()["errors"]
    assert r.json()["error"] == "fan_out_too_large" and error["loc"] == ["body", "sends", 1], r.json()
    assert "20 endpoints" in error["msg"]
    r = hooks.post("/v1/sends", json=big, headers=hooks.keys["a"])
    assert r.status_code == 202 and len(r.json()["deliveries"]) == 20, r.text


def test_an_event_all_of_whose_deliveries_are_skipped_is_checked_like_any_other(
        hooks, mock_endpoint, stack, names, redis_client, namespace):
    """Given tenant a's only endpoint for invoice.paid degraded (its deliveries are skipped at ingest, kept on the
    skipped topic to be replayed later),
    When a posts an event holding an integer no event can carry, and one over the send limit (with the same
    Idempotency-Key, retried),
    Then the first is refused 422 naming where the integer is (before: 500 "outcome unknown", and every retry under
    its key 500 again; a key that is an address is named redacted), the second 413 (before: 202 for a delivery whose replay is refused for good); a good event is
    accepted, its delivery skipped."""
    ep = _register(hooks, mock_endpoint, "resting")
    # as the endpoint-health app publishes it after 10 failures in a row
    put_acked(Producer({"bootstrap.servers": stack.bootstrap}), names.endpoint_state, ep["id"].encode(),
              orjson.dumps({"state": "degraded", "reason": "10 consecutive failures", "since_ms": 1}), 10, "health")
    wait_until(lambda: hooks.get(f"/v1/endpoints/{ep['id']}", headers=hooks.keys["a"]).json()["state"] == "degraded",
               30, "the API's endpoint view to read the endpoint's health")
    for _ in range(2):
        r = hooks.post("/v1/sends", json=event(amount=2**70), headers={**hooks.keys["a"], "Idempotency-Key": "k-1"})
        assert r.status_code == 422, r.text
        assert r.json()["errors"][0]["loc"] == ["body", "payload", "data", "amount"]
    # a payload keyed by recipient: the key is named redacted, as every validation error names an address
    r = hooks.post("/v1/sends", json=event(**{"jane@example.test": 2**70}), headers=hooks.keys["a"])
    assert r.status_code == 422 and "jane" not in r.text, r.text
    assert r.json()["errors"][0]["loc"] == ["body", "payload", "data", "***@***"]
    r = hooks.post("/v1/sends", json=event(blob="x" * (MAX_SEND_BYTES + 1024)), headers=hooks.keys["a"])
    assert r.status_code == 413, r.text
    r = hooks.post("/v1/sends", json=event(), headers=hooks.keys["a"])
    assert r.status_code == 202, r.text
    assert [d.get("skipped") for d in r.json()["deliveries"]] == ["endpoint_degraded"], r.json()


def test_a_failing_endpoint_gets_exactly_nine_attempts_on_the_schedule_then_the_delivery_is_dropped(
        hooks, mock_endpoint, stack, names):
    """Given an endpoint answering 500 and the webhook schedule shrunk 5,000 times (same code path),
    When an event is delivered to it,
    Then it is attempted exactly 9 times, each gap at least 0.8x its tier (10 s, 1 m, 5 m, 15 m, 1 h, 3 h, 6 h, 12 h,
    scaled), and then dropped: dead-lettered with its delivery id and endpoint, status `dropped`."""
    ep = _register(hooks, mock_endpoint, "down", status=500)
    delivery_id = hooks.post("/v1/sends", json=event(), headers=hooks.keys["a"]).json()["deliveries"][0]["delivery_id"]
    done = _final(hooks, delivery_id, timeout=60)
    assert done["status"] == "dropped" and done["reason"] == "retries_exhausted"
    times = [a["at_ms"] for a in done["attempt_history"]]
    assert len(times) == 9 and mock_endpoint.stats()["endpoints"]["down"]["failed"] == 9
    for gap, tier in zip((b - a for a, b in zip(times, times[1:], strict=False)), RETRY_TIERS.values(), strict=True):
        assert gap >= 0.8 * tier * 1000 * SCALE - 5, (gap, tier)
    letter = hooks.store.get(delivery_id)
    assert letter["endpoint_id"] == ep["id"] and letter["dlq_offset"] >= 0


@pytest.mark.parametrize("status", [302, 400])
def test_redirects_and_client_errors_are_failures_that_are_retried(hooks, mock_endpoint, status):
    """Given an endpoint answering 302 (never followed) or 400,
    When an event is delivered and the endpoint is then fixed,
    Then the first attempt failed and the retry delivered it (not dead-lettered as permanent)."""
    _register(hooks, mock_endpoint, "flaky", status=status)
    delivery_id = hooks.post("/v1/sends", json=event(), headers=hooks.keys["a"]).json()["deliveries"][0]["delivery_id"]
    wait_until(lambda: mock_endpoint.stats()["endpoints"].get("flaky", {}).get("failed", 0) >= 1, 20, "a failure")
    mock_endpoint.configure("flaky", status=200)
    done = _final(hooks, delivery_id)
    assert done["status"] == "delivered" and [a["status_code"] for a in done["attempt_history"]][0] == status


def test_a_receivers_retry_after_cannot_stop_the_worker_for_everyone(hooks, mock_endpoint, processes):
    """Given tenant a's endpoint answering 429 with a Retry-After of 310 digits (a wait no clock holds),
    When an event is delivered to it, and then tenant b publishes an event to its own endpoint,
    Then the worker keeps running: b's event is delivered, and a's delivery waits to be retried, not lost
    (before, the answer overflowed the due time and crashed the worker, again on every restart)."""
    _register(hooks, mock_endpoint, "hostile", status=429, retry_after="9" * 310)
    _register(hooks, mock_endpoint, "fine", who="b")
    held = hooks.post("/v1/sends", json=event(), headers=hooks.keys["a"]).json()["deliveries"][0]["delivery_id"]
    wait_until(lambda: mock_endpoint.stats()["endpoints"].get("hostile", {}).get("failed", 0) >= 1, 20, "the 429")
    other = hooks.post("/v1/sends", json=event(), headers=hooks.keys["b"]).json()["deliveries"][0]["delivery_id"]
    assert _final(hooks, other, who="b")["status"] == "delivered"
    assert [name for name, proc, _ in processes.procs if proc.poll() is not None] == []
    assert _delivery(hooks, held)["status"] == "retrying"


def test_a_receiver_asking_to_wait_a_second_is_tried_again_held_and_not_counted_against_it(hooks, mock_endpoint,
                                                                                              stack, names):
    """Given an endpoint answering 429 with Retry-After: 1,
    When an event is delivered to it, it answers so at least twice, and is then fixed,
    Then the delivery is delivered, and each 429 is on the attempts topic as `held` (tried again in the worker
    after the wait, which endpoint health does not count as a failure: before, ten such answers in some 10 s
    degraded the endpoint and an alert said deliveries had stopped)."""
    ep = _register(hooks, mock_endpoint, "busy", status=429, retry_after="1")
    delivery_id = hooks.post("/v1/sends", json=event(), headers=hooks.keys["a"]).json()["deliveries"][0]["delivery_id"]
    wait_until(lambda: mock_endpoint.stats()["endpoints"].get("busy", {}).get("failed", 0) >= 2, 20, "two 429s")
    mock_endpoint.configure("busy", status=200)
    assert _final(hooks, delivery_id)["status"] == "delivered"
    attempts = [a for a in read_committed(stack.bootstrap, names.webhook_attempts) if a["endpoint_id"] == ep["id"]]
    throttled = [a for a in attempts if a["outcome"] == "throttled"]
    assert len(throttled) >= 2 and all(a["held"] is True for a in throttled), attempts
    assert [a["held"] for a in attempts if a["outcome"] == "delivered"] == [False]


def test_410_gone_disables_the_endpoint(hooks, mock_endpoint, processes):
    """Given an endpoint answering 410 Gone,
    When an event is delivered to it, then an operator replays its dead letter (POST /v1/admin/dlq/{id}/replay)
    twice and with `streams dlq replay`, reactivates the endpoint once its receiver answers 200 again, and replays
    it and the later event's delivery,
    Then the delivery is dropped (endpoint_gone), the endpoint is disabled, and a new event's delivery is recorded
    skipped (`endpoint_disabled`; before: no delivery at all, nothing to replay once the endpoint is fixed); both
    replays before the reactivation are refused 409 naming the reactivation, nothing replayed (before: answered
    202 with a new send id the worker then skipped as endpoint_disabled, and the dead letter marked replayed, so
    asking again answered that skipped replay); both replays after it are delivered."""
    ep = _register(hooks, mock_endpoint, "gone", status=410)
    delivery_id = hooks.post("/v1/sends", json=event(), headers=hooks.keys["a"]).json()["deliveries"][0]["delivery_id"]
    assert _final(hooks, delivery_id)["reason"] == "endpoint_gone"
    shown = wait_until(lambda: (e := hooks.get(f"/v1/endpoints/{ep['id']}", headers=hooks.keys["a"]).json())
                       ["state"] == "disabled" and e, 10, "the endpoint to be disabled")
    assert "410" in shown["state_reason"]
    [later] = hooks.post("/v1/sends", json=event(), headers=hooks.keys["a"]).json()["deliveries"]
    assert later["skipped"] == "endpoint_disabled", later  # recorded, replayable (before: no delivery, no trace)
    assert _final(hooks, later["delivery_id"])["status"] == "skipped"

    op = hooks.keys["operator"]
    for _ in range(2):  # the refusal frees its claim: asked again, it is refused again, not "replayed already"
        r = hooks.post(f"/v1/admin/dlq/{delivery_id}/replay", headers=op)
        assert r.status_code == 409, r.text
        assert f"endpoint {ep['id']} is disabled" in r.text and "reactivate" in r.text, r.text
        assert "nothing was replayed" in r.text
    cli = subprocess.run([sys.executable, "-m", "streams.cli", "dlq", "replay", delivery_id], env=processes.env,
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode != 0 and f"endpoint {ep['id']} is disabled" in cli.stderr, cli.stderr
    assert "replayed_as" not in hooks.store.get(delivery_id)
    mock_endpoint.configure("gone", status=200)
    assert hooks.post(f"/v1/admin/endpoints/{ep['id']}/reactivate", headers=op).json()["state"] == "active"
    r = wait_until(lambda: (x := hooks.post(f"/v1/admin/dlq/{delivery_id}/replay", headers=op)).status_code != 409
                   and x, 10, "the replay to be taken once the API's view has the endpoint active")
    assert r.status_code == 202, r.text
    assert _final(hooks, r.json()["send_id"])["status"] == "delivered"
    r = hooks.post(f"/v1/deliveries/{later['delivery_id']}/replay", headers=hooks.keys["a"])
    assert r.status_code == 202, r.text
    assert _final(hooks, r.json()["delivery_id"])["status"] == "delivered"


def test_signing_secrets_are_stored_sealed_and_deliveries_are_signed_with_them(hooks, mock_endpoint, stack, names,
                                                                               redis_client, namespace):
    """Given the processes running with WEBHOOK_SECRET_KEYS,
    When tenant a registers an endpoint, rotates its secret, and an event is delivered,
    Then neither any record of the operator log nor Redis holds either secret (each is stored sealed under the
    first key), and the delivery carries valid signatures of both (the receiver knows only the new one)."""
    ep = _register(hooks, mock_endpoint, "sealed")
    r = hooks.post(f"/v1/endpoints/{ep['id']}/rotate-secret", headers=hooks.keys["a"])
    assert r.status_code == 200, r.text
    rotated = r.json()["secret"]
    mock_endpoint.configure("sealed", secrets=[rotated])
    delivery_id = hooks.post("/v1/sends", json=event(), headers=hooks.keys["a"]).json()["deliveries"][0]["delivery_id"]
    assert _final(hooks, delivery_id)["status"] == "delivered"
    assert mock_endpoint.stats()["invalid_signatures"] == 0
    stored = redis_client.hget(RedisKeys(namespace).endpoints("tenant-a"), ep["id"])
    log = [m.value() or b"" for m in committed_messages(stack.bootstrap, names.operator)
           if m.key() == f"endpoint/{ep['id']}".encode()]
    assert len(log) >= 2 and stored.count(b"sealed:v1:test-2:") == 2
    for secret in (ep["secret"], rotated):
        key_text = secret.removeprefix("whsec_").encode()
        assert key_text not in stored and all(key_text not in value for value in log)


def test_a_secret_sealed_under_a_key_the_worker_lacks_is_never_sent_unsigned_and_waits_for_the_key(
        stack, namespace, names, channel_topics, limits, processes, redis_client, mock_endpoint):
    """Given an endpoint whose current secret was sealed (by an operator's store) under key `gone`, which the
    webhook worker is not given, and a retry schedule shrunk 333 times,
    When an event is delivered, and the worker is then replaced by one given `gone` as well,
    Then the first worker sends nothing to the receiver (its attempts fail as `secret_unreadable`), the
    endpoint stays active (our failure, not the receiver's), and the second worker delivers it, signed with
    both secrets (the receiver knows only the new one)."""
    hooks = _hooks(namespace, channel_topics, limits, processes, redis_client, 0.003, worker=False)
    ep = _register(hooks, mock_endpoint, "locked")
    gone = f"gone:{base64.b64encode(b'g' * 32).decode()}"
    operator = EndpointStore(redis_client, namespace, OperatorLog(stack.bootstrap, names.operator),
                             UrlPolicy(require_https=False, allow=frozenset({"127.0.0.1"})), system_resolver,
                             Sealer.parse(gone))
    mock_endpoint.configure("locked", secrets=[operator.rotate_secret("tenant-a", ep["id"])])
    first = _webhook_worker(processes)  # started after the rotation: its view holds it
    delivery_id = hooks.post("/v1/sends", json=event(), headers=hooks.keys["a"]).json()["deliveries"][0]["delivery_id"]
    wait_until(lambda: any(a.get("error") == "secret_unreadable"
                           for a in _delivery(hooks, delivery_id).get("attempt_history", [])), 30,
               "an attempt to fail as secret_unreadable")
    first.send_signal(signal.SIGTERM)
    first.wait(30)
    assert mock_endpoint.stats()["endpoints"].get("locked", {}).get("requests", 0) == 0
    _webhook_worker(processes, "webhook-worker-2", env={"WEBHOOK_SECRET_KEYS": f"{TEST_SECRET_KEYS},{gone}"})
    done = _final(hooks, delivery_id, timeout=90)
    assert done["status"] == "delivered", done
    assert mock_endpoint.stats()["invalid_signatures"] == 0
    shown = hooks.get(f"/v1/endpoints/{ep['id']}", headers=hooks.keys["a"]).json()
    assert shown["state"] == "active", shown


def test_a_410_from_the_old_url_after_the_tenant_moved_the_endpoint_neither_disables_nor_drops(hooks, mock_endpoint):
    """Given an endpoint whose receiver answers 410 Gone after 6 s (time for the change below, and within the 10 s timeout),
    When an event is delivered to it and, while that request is on its way, the tenant changes the endpoint's URL,
    Then the endpoint stays active and the delivery is retried at the new URL and delivered (before, the old URL's
    answer disabled the endpoint the tenant had just fixed, and dropped the delivery)."""
    ep = _register(hooks, mock_endpoint, "moving", status=410, latency_ms=6000)
    mock_endpoint.configure("moved", secrets=[ep["secret"]])
    delivery_id = hooks.post("/v1/sends", json=event(), headers=hooks.keys["a"]).json()["deliveries"][0]["delivery_id"]
    wait_until(lambda: mock_endpoint.stats()["endpoints"].get("moving", {}).get("requests", 0) >= 1, 20,
               "the request to the old URL")
    r = hooks.patch(f"/v1/endpoints/{ep['id']}", json={"url": mock_endpoint.url("moved")}, headers=hooks.keys["a"])
    assert r.status_code == 200, r.text
    done = _final(hooks, delivery_id)
    assert done["status"] == "delivered", done
    assert [a["status_code"] for a in done["attempt_history"]] == [410, 200]
    shown = hooks.get(f"/v1/endpoints/{ep['id']}", headers=hooks.keys["a"]).json()
    assert shown["state"] == "active" and shown["url"] == mock_endpoint.url("moved")
    assert mock_endpoint.stats()["endpoints"]["moving"]["failed"] == 1


def test_replay_is_a_new_delivery_and_refused_after_the_payload_expired(hooks, mock_endpoint, stack, names):
    """Given a delivered event,
    When tenant a replays the delivery, and replays the endpoint's deliveries in bulk twice,
    Then the replay arrives with a new webhook-id and carries replay_of; a bulk replay replays each failed delivery
    once however often it is asked, and not one replayed alone already, and only final outcomes may be asked for (422); and a replay of a delivery whose payload is older than 7 days fails saying so."""
    ep = _register(hooks, mock_endpoint, "fixme", status=500)
    ids = [hooks.post("/v1/sends", json=event(), headers=hooks.keys["a"]).json()["deliveries"][0]["delivery_id"]
           for _ in range(2)]
    for i in ids:
        assert _final(hooks, i, timeout=60)["status"] == "dropped"
    mock_endpoint.configure("fixme", status=200)

    r = hooks.post(f"/v1/deliveries/{ids[0]}/replay", headers=hooks.keys["a"])
    assert r.status_code == 202 and r.json()["replay_of"] == ids[0] and r.json()["delivery_id"] != ids[0]
    again = _final(hooks, r.json()["delivery_id"])
    assert again["status"] == "delivered" and again["replay_of"] == ids[0]
    assert r.json()["delivery_id"] in mock_endpoint.stats(deliveries=True)["deliveries"]

    since = int(time.time() * 1000) - 600_000
    first = hooks.post(f"/v1/endpoints/{ep['id']}/replay", json={"since_ms": since}, headers=hooks.keys["a"]).json()
    second = hooks.post(f"/v1/endpoints/{ep['id']}/replay", json={"since_ms": since}, headers=hooks.keys["a"]).json()
    # ids[0], replayed alone above, is passed over (before: replayed again, a second copy under a new webhook-id)
    assert [x["replay_of"] for x in first["replayed"]] == [ids[1]] and first["already_replayed"] == 1
    assert second["replayed"] == [] and second["already_replayed"] == 2
    # Final outcomes only: a delivery still under way would be refused, and its claim kept it out for good.
    under_way = hooks.post(f"/v1/endpoints/{ep['id']}/replay", json={"since_ms": since, "statuses": ["retrying"]},
                           headers=hooks.keys["a"])
    assert under_way.status_code == 422 and "statuses" in under_way.text, under_way.text

    with pytest.raises(ReplayRefused, match="has expired: payloads are kept 7 days"):
        replay(stack.bootstrap, names, hooks.store, None, ids[1], now_ms=int(time.time() * 1000) + 8 * 86_400_000)


def test_a_replay_to_an_endpoint_that_takes_no_deliveries_is_refused_and_can_be_asked_again(hooks, mock_endpoint):
    """Given a delivered event, then its endpoint disabled by its tenant,
    When the tenant replays the delivery, alone and in bulk, then enables the endpoint and replays in bulk again,
    Then both replays are refused 409 naming what to do, nothing replayed; the bulk replay after enabling replays it
    and it is delivered (before: replayed, skipped by the worker as endpoint_disabled, and the original marked
    replayed all the same: every later bulk replay passed it over as already replayed). A range that ends before
    it starts, and a body field the API does not know (a misspelt one), are 422 naming it: nothing is replayed or
    changed without a word."""
    ep = _register(hooks, mock_endpoint, "paused")
    delivery_id = hooks.post("/v1/sends", json=event(), headers=hooks.keys["a"]).json()["deliveries"][0]["delivery_id"]
    assert _final(hooks, delivery_id)["status"] == "delivered"
    a = hooks.keys["a"]
    assert hooks.patch(f"/v1/endpoints/{ep['id']}", json={"enabled": False}, headers=a).status_code == 200
    bulk = {"since_ms": int(time.time() * 1000) - 600_000, "statuses": ["delivered"]}

    refused = hooks.post(f"/v1/endpoints/{ep['id']}/replay", json=bulk, headers=a)
    assert refused.status_code == 409 and refused.json()["error"] == "endpoint_not_deliverable", refused.text
    assert "enable it" in refused.text and "nothing was replayed" in refused.text
    refused = hooks.post(f"/v1/deliveries/{delivery_id}/replay", headers=a)
    assert refused.status_code == 409 and refused.json()["error"] == "endpoint_not_deliverable", refused.text

    for bad, field in (({**bulk, "until_ms": 0}, "since_ms"), ({**bulk, "limt": 3}, "limt")):
        r = hooks.post(f"/v1/endpoints/{ep['id']}/replay", json=bad, headers=a)
        assert r.status_code == 422 and field in r.text, r.text
    r = hooks.patch(f"/v1/endpoints/{ep['id']}", json={"enabled": True, "eventTypes": ["x.y"]}, headers=a)
    assert r.status_code == 422 and "eventTypes" in r.text, r.text
    assert hooks.get(f"/v1/endpoints/{ep['id']}", headers=a).json()["enabled"] is False

    assert hooks.patch(f"/v1/endpoints/{ep['id']}", json={"enabled": True}, headers=a).status_code == 200
    r = hooks.post(f"/v1/endpoints/{ep['id']}/replay", json=bulk, headers=a)
    assert r.status_code == 202 and [x["replay_of"] for x in r.json()["replayed"]] == [delivery_id], r.text
    assert _final(hooks, r.json()["replayed"][0]["delivery_id"])["status"] == "delivered"


def test_replays_are_charged_to_the_tenants_ingest_quotas(hooks, mock_endpoint, limits):
    """Given tenant a's 3 delivered events, and then a's transactional ingest quota set to a burst of 2 (refilling
    one a day),
    When a replays the endpoint's delivered deliveries in bulk (up to 10), and then the third one alone,
    Then the bulk replay publishes 2 and stops with 429 and Retry-After, naming the 2 it replayed; the single replay
    is refused 429 too, nothing published (before: every replay published, the quota never charged); once the quota
    allows, a bulk replay goes on with the third (its claim was freed) and only it."""
    ep = _register(hooks, mock_endpoint, "replayed")
    ids = [hooks.post("/v1/sends", json=event(), headers=hooks.keys["a"]).json()["deliveries"][0]["delivery_id"]
           for _ in range(3)]
    for i in ids:
        assert _final(hooks, i)["status"] == "delivered"
    limits.set_provider("ingest-transactional", 1_000_000, 1_000_000)
    limits.set_tenant("ingest-transactional", "tenant-a", 1 / 86_400, 2)
    now_ms = int(time.time() * 1000)  # the replays are created later: never candidates themselves
    bulk = {"since_ms": now_ms - 600_000, "until_ms": now_ms + 1, "statuses": ["delivered"], "limit": 10}

    r = hooks.post(f"/v1/endpoints/{ep['id']}/replay", json=bulk, headers=hooks.keys["a"])
    assert r.status_code == 429 and int(r.headers["retry-after"]) > 0, r.text
    assert [x["replay_of"] for x in r.json()["replayed"]] == ids[:2]
    assert "ingest-transactional quota" in r.json()["errors"][0]["msg"]
    r = hooks.post(f"/v1/deliveries/{ids[2]}/replay", headers=hooks.keys["a"])
    assert r.status_code == 429 and "nothing was replayed" in r.text, r.text

    limits.set_tenant("ingest-transactional", "tenant-a", 1000, 10)
    r = wait_until(lambda: (a := hooks.post(f"/v1/endpoints/{ep['id']}/replay", json=bulk,
                                            headers=hooks.keys["a"])).status_code == 202 and a, 30,
                   "the quota to allow the replay")
    assert [x["replay_of"] for x in r.json()["replayed"]] == [ids[2]] and r.json()["already_replayed"] == 2


def test_endpoints_and_deliveries_are_private_to_their_tenant(hooks, mock_endpoint):
    """Given tenant a's endpoint and one of its deliveries,
    When tenant b reads, changes, deletes or replays them,
    Then every answer is 404, and b's own event does not reach a's endpoint."""
    ep = _register(hooks, mock_endpoint, "private")
    delivery_id = hooks.post("/v1/sends", json=event(), headers=hooks.keys["a"]).json()["deliveries"][0]["delivery_id"]
    _final(hooks, delivery_id)
    b = hooks.keys["b"]
    assert hooks.get(f"/v1/endpoints/{ep['id']}", headers=b).status_code == 404
    assert hooks.patch(f"/v1/endpoints/{ep['id']}", json={"enabled": False}, headers=b).status_code == 404
    assert hooks.delete(f"/v1/endpoints/{ep['id']}", headers=b).status_code == 404
    assert hooks.get(f"/v1/deliveries/{delivery_id}", headers=b).status_code == 404
    assert hooks.post(f"/v1/deliveries/{delivery_id}/replay", headers=b).status_code == 404
    assert hooks.get("/v1/endpoints", headers=b).json()["endpoints"] == []
    assert hooks.post("/v1/sends", json=event(), headers=b).json()["deliveries"] == []


@pytest.mark.parametrize("url, why", [("http://10.0.0.5/hook", "private"), ("http://169.254.169.254/latest", "metadata"),
                                      ("http://[::1]:9/x", "loopback")])
def test_urls_into_private_networks_are_refused_at_registration(hooks, url, why):
    """Given the operator allows only 127.0.0.1,
    When a tenant registers an endpoint whose host is private, cloud metadata or an IPv6 loopback,
    Then the API refuses it (422) saying why, and nothing is sent there."""
    r = hooks.post("/v1/endpoints", json={"url": url, "event_types": ["*"]}, headers=hooks.keys["a"])
    assert r.status_code == 422 and why in r.text


def test_an_endpoint_no_event_could_reach_or_too_large_to_store_is_refused_saying_why(hooks, mock_endpoint):
    """Given a tenant registering endpoints,
    When one subscribes to "invoice paid" (no event type has a space), one lists 101 event types, and one has a
    3,000-character URL (an endpoint is one operator-log record; one over its size limit was refused with a 503
    on every try),
    Then each is refused 422 naming the field, and the tenant has no endpoint; "invoice.paid" and '*' are taken."""
    a = hooks.keys["a"]
    url = mock_endpoint.url("bounded")
    spaced = hooks.post("/v1/endpoints", json={"url": url, "event_types": ["invoice.paid", "invoice paid"]}, headers=a)
    assert spaced.status_code == 422 and "event_types[1] is not an event type" in spaced.text, spaced.text
    many = hooks.post("/v1/endpoints", json={"url": url, "event_types": [f"e.{i}" for i in range(101)]}, headers=a)
    assert many.status_code == 422 and "1 to 100 event types" in many.text, many.text
    long_url = hooks.post("/v1/endpoints", json={"url": url + "?" + "x" * 3000, "event_types": ["*"]}, headers=a)
    assert long_url.status_code == 422 and "url" in long_url.text, long_url.text
    assert hooks.get("/v1/endpoints", headers=a).json()["endpoints"] == []
    taken = hooks.post("/v1/endpoints", json={"url": url, "event_types": ["invoice.paid", "*"]}, headers=a)
    assert taken.status_code == 201, taken.text


def test_a_delivery_waiting_its_turn_is_found_and_listed(namespace, channel_topics, limits, processes, redis_client,
                                                         mock_endpoint):
    """Given tenant a's endpoint and no webhook worker running yet (its deliveries wait),
    When a publishes an event,
    Then its delivery is found at once (status accepted, naming its endpoint and event) and listed under its
    endpoint (before: 404 "no such delivery" and an empty list until its first attempt, minutes or hours behind
    a slow endpoint); once a worker runs it is delivered and still listed once. An outcome of tenant b's filed
    under a's endpoint (an event of b's naming it, written to the lane past ingest) is not listed to a, and does not
    shorten a's page."""
    hooks = _hooks(namespace, channel_topics, limits, processes, redis_client, SCALE, worker=False)
    ep = _register(hooks, mock_endpoint, "waiting")
    [delivery] = hooks.post("/v1/sends", json=event(), headers=hooks.keys["a"]).json()["deliveries"]
    found = hooks.get(f"/v1/deliveries/{delivery['delivery_id']}", headers=hooks.keys["a"])
    assert found.status_code == 200, found.text
    assert (found.json()["status"], found.json()["endpoint_id"], found.json()["event_type"]) == (
        "accepted", ep["id"], "invoice.paid")
    StatusStore(redis_client, namespace).record_outcome(
        {"send_id": "forged-by-b", "tenant_id": "tenant-b", "channel": "webhook", "lane": "transactional",
         "status": "dead_lettered", "reason": "rejected", "attempts": 1, "endpoint_id": ep["id"],
         "created_at_ms": int(time.time() * 1000)})
    listed = hooks.get(f"/v1/endpoints/{ep['id']}/deliveries", headers=hooks.keys["a"]).json()["deliveries"]
    assert [d["delivery_id"] for d in listed] == [delivery["delivery_id"]]
    # b's newer entry does not take the place of a's on a page of one (before: an empty page, read as the end)
    listed = hooks.get(f"/v1/endpoints/{ep['id']}/deliveries?limit=1", headers=hooks.keys["a"]).json()["deliveries"]
    assert [d["delivery_id"] for d in listed] == [delivery["delivery_id"]]
    assert hooks.get(f"/v1/deliveries/{delivery['delivery_id']}", headers=hooks.keys["b"]).status_code == 404
    _webhook_worker(processes)
    assert _final(hooks, delivery["delivery_id"])["status"] == "delivered"
    listed = hooks.get(f"/v1/endpoints/{ep['id']}/deliveries", headers=hooks.keys["a"]).json()["deliveries"]
    assert [d["delivery_id"] for d in listed] == [delivery["delivery_id"]]


def test_an_endpoints_deliveries_are_paged_each_once_even_within_one_millisecond(
        namespace, channel_topics, limits, processes, redis_client, mock_endpoint):
    """Given tenant a's endpoint with 5 deliveries created in one millisecond (a batch's events share one) and 2
    older, and 3 outcomes of tenant b's naming a's endpoint (written past ingest), newer than all of them,
    When a reads its deliveries 2 at a time, each page from the `next_cursor` of the page before,
    Then every one of a's 7 deliveries is listed once, newest first, on full pages of 2 then 1, the last page
    says there is none after it, b's are never listed, and the SDK's `all_deliveries` reads the same (before:
    paging on by `before_ms` = the last one's time skipped the other 3 of that millisecond, and b's entries
    took the places of a's). A cursor that is not one the API gave is refused, naming the cursor."""
    hooks = _hooks(namespace, channel_topics, limits, processes, redis_client, SCALE, worker=False)
    ep = _register(hooks, mock_endpoint, "paged")
    created = {**{f"d-same-{i}": 5_000 for i in range(5)}, "d-older-0": 4_000, "d-older-1": 3_000}
    for delivery_id, at in [*created.items(), *((f"b-{i}", 9_000) for i in range(3))]:
        hooks.store.record_outcome({"send_id": delivery_id, "status": "dropped", "created_at_ms": at,
                                    "completed_at_ms": at + 1, "endpoint_id": ep["id"],
                                    "tenant_id": "tenant-b" if delivery_id.startswith("b-") else "tenant-a"})
    pages, params = [], {"limit": 2}
    while True:
        r = hooks.get(f"/v1/endpoints/{ep['id']}/deliveries", params=params, headers=hooks.keys["a"])
        assert r.status_code == 200, r.text
        pages.append([d["delivery_id"] for d in r.json()["deliveries"]])
        if r.json()["next_cursor"] is None:
            break
        params["cursor"] = r.json()["next_cursor"]
    newest_first = sorted(created, key=lambda d: (created[d], d), reverse=True)
    assert pages == [newest_first[0:2], newest_first[2:4], newest_first[4:6], newest_first[6:]]

    sdk = WebhooksClient(str(hooks.base_url), hooks.keys["a"]["Authorization"].removeprefix("Bearer "))
    assert [d["delivery_id"] for d in sdk.all_deliveries(ep["id"], page_size=3)] == newest_first

    for forged in ("nonsense", "OTk5OQ", params["cursor"] + "!"):  # not base64 / no id / not its form
        r = hooks.get(f"/v1/endpoints/{ep['id']}/deliveries", params={"cursor": forged}, headers=hooks.keys["a"])
        assert r.status_code == 422 and r.json()["errors"][0]["loc"] == ["query", "cursor"], (forged, r.text)


def test_deliveries_recorded_in_the_index_of_before_are_still_listed_and_replayed(
        namespace, channel_topics, limits, processes, redis_client, mock_endpoint):
    """Given tenant a's endpoint with a dropped delivery recorded in the index of before the per-tenant one (by a
    recorder of the version before, as during a rollout), one of tenant b's filed there too, and a delivery in the
    new index,
    When a lists the endpoint's deliveries and replays its dropped ones,
    Then both of a's are listed, newest first, b's not, and the bulk replay finds the old one (before: the index
    moved and nothing recorded before the upgrade was listed or replayable by range, for 30 days)."""
    hooks = _hooks(namespace, channel_topics, limits, processes, redis_client, SCALE, worker=False)
    ep = _register(hooks, mock_endpoint, "upgraded")
    keys = RedisKeys(namespace)
    for delivery_id, tenant, at in (("d-old", "tenant-a", 1_000), ("d-b", "tenant-b", 1_500)):
        redis_client.zadd(keys.legacy_endpoint_deliveries(ep["id"]), {delivery_id: at})
        redis_client.hset(keys.send_status(delivery_id), mapping={
            "status": "dropped", "tenant_id": tenant, "channel": "webhook", "lane": "transactional",
            "endpoint_id": ep["id"], "event_type": "invoice.paid"})
    hooks.store.record_outcome({"send_id": "d-new", "status": "delivered", "created_at_ms": 2_000,
                                "completed_at_ms": 2_001, "endpoint_id": ep["id"], "tenant_id": "tenant-a"})
    listed = hooks.get(f"/v1/endpoints/{ep['id']}/deliveries", headers=hooks.keys["a"]).json()
    assert [d["delivery_id"] for d in listed["deliveries"]] == ["d-new", "d-old"] and listed["next_cursor"] is None
    r = hooks.post(f"/v1/endpoints/{ep['id']}/replay", json={"since_ms": 0}, headers=hooks.keys["a"])
    # found by the range read, and refused only for its payload, written nowhere by this test
    assert r.status_code == 202 and [d["delivery_id"] for d in r.json()["refused"]] == ["d-old"], r.text


def test_a_rotated_secret_signs_alongside_the_old_one(hooks, mock_endpoint):
    """Given an endpoint whose receiver knows only the old secret, then only the new one,
    When the tenant rotates the secret and an event is delivered,
    Then both receivers accept it: the old secret stays valid 24 h and both sign meanwhile."""
    ep = _register(hooks, mock_endpoint, "rotating")  # the receiver knows the first secret only
    new = hooks.post(f"/v1/endpoints/{ep['id']}/rotate-secret", headers=hooks.keys["a"]).json()["secret"]
    first = hooks.post("/v1/sends", json=event(), headers=hooks.keys["a"]).json()["deliveries"][0]["delivery_id"]
    assert _final(hooks, first)["status"] == "delivered"
    mock_endpoint.configure("rotating", secrets=[new])
    second = hooks.post("/v1/sends", json=event(), headers=hooks.keys["a"]).json()["deliveries"][0]["delivery_id"]
    assert _final(hooks, second)["status"] == "delivered"
    assert mock_endpoint.stats()["invalid_signatures"] == 0


def test_a_killed_webhook_worker_loses_nothing_and_receivers_dedupe_by_webhook_id(
        hooks, mock_endpoint, processes):
    """Given 300 events for a slow endpoint (300 ms) being delivered,
    When the webhook worker is killed with kill -9 mid-run and a new one starts,
    Then every delivery arrives; the few the kill left in flight may arrive twice, always with the same
    webhook-id (so a receiver deduplicates them), and no delivery is marked anything but delivered."""
    _register(hooks, mock_endpoint, "slow", latency_ms=300)
    ids: list[str] = []
    for _ in range(3):
        body = hooks.post("/v1/sends/batch", json={"sends": [event()] * 100}, headers=hooks.keys["a"]).json()
        ids += [d["delivery_id"] for s in body["sends"] for d in s["deliveries"]]
    worker = processes.procs[0][1]
    wait_until(lambda: mock_endpoint.stats()["delivered"] >= 50, 60, "deliveries under way")
    worker.send_signal(signal.SIGKILL)
    worker.wait(10)
    processes.start("webhook-worker-2", "worker", "--channel", "webhook", "--lane", "transactional",
                    ready="consuming")
    wait_until(lambda: set(ids) <= set(mock_endpoint.stats(deliveries=True)["deliveries"]), 120,
               "every delivery to arrive", interval=0.5)
    stats = mock_endpoint.stats()
    assert stats["duplicates"] <= 40, stats["duplicates"]  # at most what was in flight at the kill (per-endpoint cap 20)
    print(f"duplicates after kill -9 (same webhook-id, deduplicated by receivers): {stats['duplicates']}")


def test_a_bulk_replay_that_published_nothing_is_replayed_by_the_next_one_and_no_other_twice(redis_client,
                                                                                            namespace):
    """Given five deliveries a bulk replay takes in turn,
    When the first one's publish fails with nothing published, the second one's payload is not read in time, the
    third one's publish is left unknown by the broker, the fourth is refused for good (its payload expired), the
    fifth is published, and a sixth is refused until its unknown outcome is checked with the provider, and the
    endpoint's deliveries are replayed in bulk again,
    Then the first two are replayed then (they were lost to bulk replays before: counted as already replayed, never
    sent), and so is the sixth once checked (its claim kept it from the operator's checked replay before), and
    neither the third (it may have been sent), the fourth nor the fifth is replayed a second time."""
    store = StatusStore(redis_client, namespace)
    published: list[str] = []

    def publish(delivery_id: str, failure: Exception | None = None):
        def do_replay():
            if failure is not None:
                raise failure
            published.append(delivery_id)
            return SimpleNamespace(send_id=f"replay-of-{delivery_id}")
        return do_replay

    with pytest.raises(PublishError):
        replay_once(store, "d-refused", publish("d-refused", PublishError("the broker refused it")))
    with pytest.raises(BrokerUnavailable):
        replay_once(store, "d-unread", publish("d-unread", BrokerUnavailable("the payload was not read in time")))
    with pytest.raises(PublishOutcomeUnknown):
        replay_once(store, "d-unknown", publish("d-unknown", PublishOutcomeUnknown("no acknowledgement")))
    with pytest.raises(ReplayRefused):
        replay_once(store, "d-expired", publish("d-expired", ReplayRefused("its payload has expired")))
    with pytest.raises(ReplayNeedsCheck):  # until the operator checked the provider: its claim is freed
        replay_once(store, "d-unchecked", publish("d-unchecked", ReplayNeedsCheck("dropped unknown_outcome")))
    assert replay_once(store, "d-sent", publish("d-sent")).send_id == "replay-of-d-sent"

    assert replay_once(store, "d-refused", publish("d-refused")).send_id == "replay-of-d-refused"
    assert replay_once(store, "d-unread", publish("d-unread")).send_id == "replay-of-d-unread"
    assert replay_once(store, "d-unknown", publish("d-unknown")) is None
    assert replay_once(store, "d-expired", publish("d-expired")) is None  # refused for good: not tried again
    assert replay_once(store, "d-sent", publish("d-sent")) is None
    assert replay_once(store, "d-unchecked", publish("d-unchecked")).send_id == "replay-of-d-unchecked"
    assert published == ["d-sent", "d-refused", "d-unread", "d-unchecked"]
    assert store.get("d-refused")["replayed_as"] == "replay-of-d-refused"


def test_a_bulk_replay_stopped_by_a_failure_names_what_it_replayed_and_the_next_call_goes_on(redis_client,
                                                                                            namespace):
    """Given four dropped deliveries of a tenant's endpoint (and one of another tenant among them),
    When a bulk replay meets a broker that does not answer at the third, and is called again once it does,
    Then the first call stops there with BulkReplayStopped carrying the two deliveries it replayed (answered
    503 naming them: they are published, and the client could not learn their ids otherwise); the second
    call replays the third and fourth and counts the first two as already replayed; the other tenant's
    delivery is never touched."""
    store = StatusStore(redis_client, namespace)
    ids = [f"d-{i}" for i in range(4)]
    for i, d in enumerate([*ids[:2], "d-other", *ids[2:]]):
        store.record_outcome({"send_id": d, "status": "dropped", "completed_at_ms": 1000 + i, "endpoint_id": "ep",
                              "tenant_id": "tenant-b" if d == "d-other" else "tenant-a"})
    candidates = [*ids[:2], "d-other", *ids[2:]]
    broker_answers = False

    def replay_it(delivery_id: str):
        assert delivery_id != "d-other", "another tenant's delivery was replayed"
        if delivery_id == "d-2" and not broker_answers:
            raise BrokerUnavailable("the payload was not read in time")
        return SimpleNamespace(send_id=f"replay-of-{delivery_id}")

    with pytest.raises(BulkReplayStopped) as stopped:
        replay_in_turn(store, candidates, "tenant-a", ["dropped"], 100, replay_it)
    assert stopped.value.replayed == [{"delivery_id": "replay-of-d-0", "replay_of": "d-0"},
                                      {"delivery_id": "replay-of-d-1", "replay_of": "d-1"}]
    answer = _stopped(stopped.value)
    assert answer.status_code == 503 and answer.detail["replayed"] == stopped.value.replayed
    assert "at delivery d-2" in answer.detail["errors"][0]["msg"] and "outcome" not in answer.detail

    broker_answers = True
    again = replay_in_turn(store, candidates, "tenant-a", ["dropped"], 100, replay_it)
    assert [r["replay_of"] for r in again["replayed"]] == ["d-2", "d-3"] and again["already_replayed"] == 2


def test_a_bulk_replay_the_broker_left_unknown_names_the_id_to_look_up():
    """A bulk replay stopped by an unconfirmed publish is answered 503 "outcome": "unknown" naming the id the
    replay may have been published as, and what it replayed before."""
    done = [{"delivery_id": "replay-of-d-0", "replay_of": "d-0"}]
    answer = _stopped(BulkReplayStopped(done, "d-1", ReplayOutcomeUnknown("no acknowledgement", "r-1")))
    assert answer.status_code == 503 and answer.detail["outcome"] == "unknown" and answer.detail["replayed"] == done
    assert "published as delivery r-1" in answer.detail["errors"][0]["msg"]


def test_a_bulk_replay_whose_store_fails_mid_way_still_names_every_replay_it_published(redis_client, namespace):
    """Given three dropped deliveries of a tenant, and a state store that stops answering (a client pointed at a
    closed port) while the second one's replay is being published,
    When the endpoint's deliveries are replayed in bulk,
    Then the second replay, published though it could not be recorded as such, is in `replayed` with the first;
    the stop at the third names no delivery (its owner could not be checked); a release that fails keeps the
    claim and the answer says how to replay that delivery alone; anything unexpected is a 500 that still
    names what was replayed."""
    import redis as redis_lib

    store = StatusStore(redis_client, namespace)
    for i in range(3):
        store.record_outcome({"send_id": f"d-{i}", "status": "dropped", "completed_at_ms": 1000 + i,
                              "endpoint_id": "ep", "tenant_id": "tenant-a"})
    dead = redis_lib.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=1)

    def store_dies_during(delivery_id: str, then: Exception | None = None):
        def replay_it(d: str):
            if d == delivery_id:
                store.client = dead
                if then is not None:
                    raise then
            return SimpleNamespace(send_id=f"replay-of-{d}")
        return replay_it

    with pytest.raises(BulkReplayStopped) as stopped:
        replay_in_turn(store, ["d-0", "d-1", "d-2"], "tenant-a", ["dropped"], 100, store_dies_during("d-1"))
    assert [r["replay_of"] for r in stopped.value.replayed] == ["d-0", "d-1"]
    answer = _stopped(stopped.value)
    assert answer.status_code == 503 and "state store did not answer at the next delivery" in \
        answer.detail["errors"][0]["msg"] and "d-2" not in answer.detail["errors"][0]["msg"]

    store.client = redis_client
    with pytest.raises(BulkReplayStopped) as kept:
        replay_in_turn(store, ["d-2"], "tenant-a", ["dropped"], 100,
                       store_dies_during("d-2", BrokerUnavailable("the payload was not read in time")))
    msg = _stopped(kept.value).detail["errors"][0]["msg"]
    assert "POST /v1/deliveries/d-2/replay" in msg and "bulk replays skip it" in msg
    store.client = redis_client
    assert replay_in_turn(store, ["d-2"], "tenant-a", ["dropped"], 100, store_dies_during("none"))[
        "already_replayed"] == 1  # the kept claim: never replayed twice

    store.record_outcome({"send_id": "d-3", "status": "dropped", "completed_at_ms": 1004, "endpoint_id": "ep",
                          "tenant_id": "tenant-a"})

    def broken(d: str):
        raise ZeroDivisionError("a bug")

    with pytest.raises(BulkReplayStopped) as unexpected:
        replay_in_turn(store, ["d-3"], "tenant-a", ["dropped"], 100, broken)
    answer = _stopped(unexpected.value)
    assert answer.status_code == 500 and answer.detail["replayed"] == [] and "a bug" not in str(answer.detail)


def test_an_endpoints_deliveries_are_listed_a_bounded_page_at_a_time(redis_client, namespace):
    """Given an endpoint with 5 deliveries created one millisecond apart,
    When its deliveries of a range are listed with a bound of 3 (a bulk replay looks at 10,000 per call),
    Then the 3 oldest come back with when each was created, where the next call starts (before: every delivery of
    the range in one Redis call: millions for a busy endpoint over 30 days, on the API's shared threads)."""
    store = StatusStore(redis_client, namespace)
    for i in range(5):
        store.record_outcome({"send_id": f"d-{i}", "status": "dropped", "created_at_ms": 1000 + i,
                              "completed_at_ms": 2000 + i, "endpoint_id": "ep", "tenant_id": "tenant-a"})
    assert store.endpoint_deliveries_between("ep", "tenant-a", 0, 10**13, 3) == [
        ("d-0", 1000), ("d-1", 1001), ("d-2", 1002)]
    assert store.endpoint_deliveries_between("ep", "tenant-a", 1002, 10**13, 3) == [
        ("d-2", 1002), ("d-3", 1003), ("d-4", 1004)]


def test_following_next_since_ms_replays_every_delivery_of_the_range_once(redis_client, namespace):
    """Given an endpoint with 5 dropped deliveries,
    When bulk replays with a limit of 2 each follow the `next_since_ms` of the answer before,
    Then every delivery is replayed once, in three calls, the last answering no next_since_ms (before:
    next_since_ms named the end of the page read, past deliveries a call stopped short of at its limit, which
    a client following it never replayed)."""
    store = StatusStore(redis_client, namespace)
    for i in range(5):
        store.record_outcome({"send_id": f"d-{i}", "status": "dropped", "created_at_ms": 1000 + i,
                              "completed_at_ms": 2000 + i, "endpoint_id": "ep", "tenant_id": "tenant-a"})
    since, replayed, calls = 0, [], 0
    while since is not None:
        calls += 1
        listed = store.endpoint_deliveries_between("ep", "tenant-a", since, 10**13, 10_001)
        answer = replay_in_turn(store, [d for d, _ in listed], "tenant-a", ["dropped"], 2,
                                lambda d: SimpleNamespace(send_id=f"replay-of-{d}"))
        replayed += [r["replay_of"] for r in answer["replayed"]]
        since = next_since(listed, answer["considered"])
    assert (replayed, calls) == ([f"d-{i}" for i in range(5)], 3)


def test_a_tenants_receiver_timing_out_does_not_hold_the_lanes_lag_for_every_tenant(
        stack, namespace, names, channel_topics, limits, processes, redis_client, mock_endpoint):
    """Given one webhook lane partition shared by tenants a and b, attempts timing out after 2 s, a's receiver never
    answering and b's answering at once, both tenants' buckets far above what they send,
    When a publishes 2 events a second and b 8 a second for 25 s,
    Then from the 10th second on the lane's committed lag stays under the yield threshold (100 messages), and b's
    events are delivered. Before, a's deliveries waited in the worker for their turn at one attempt each 2 s (its
    bucket allowed far more, and the share was sized by it), the oldest pinning the partition's committed offset:
    b's deliveries behind it counted as transactional lag, over 100 within seconds, pausing every tenant's
    marketing webhooks for as long as a's receiver kept failing."""
    processes.env["WEBHOOK_TIMEOUT_S"] = "2"
    api = _hooks(namespace, lambda channel: channel_topics(channel, lane_partitions=1), limits, processes,
                 redis_client, 1.0)
    _register(api, mock_endpoint, "a-hook", who="a", timeout=True)
    _register(api, mock_endpoint, "b-hook", who="b")
    group, topic = names.group("webhook", "transactional"), names.lane("webhook", "transactional")

    started, lags = time.monotonic(), []
    for second in range(25):
        for who, n in (("a", 2), ("b", 8)):
            r = api.post("/v1/sends/batch", json={"sends": [event()] * n}, headers=api.keys[who])
            assert r.status_code == 202, r.text
        if second >= 10:
            lags.append(committed_lag(stack.bootstrap, group, topic))
        time.sleep(max(0.0, started + second + 1 - time.monotonic()))  # the tenants' pace, not a wait for us

    print(f"the lane's committed lag from the 10th second on: {lags}")
    assert max(lags) < 100, lags
    wait_until(lambda: mock_endpoint.stats()["endpoints"].get("b-hook", {}).get("ok", 0) >= 200, 30,
               "b's 200 deliveries")


def test_a_worker_draining_still_follows_the_endpoint_view_for_a_delivery_waiting_on_it(
        stack, namespace, channel_topics, limits, processes, redis_client, mock_endpoint, dispatch_env, monkeypatch):
    """Given a webhook worker whose endpoint view is held back (its polls do nothing) while a tenant registers an
    endpoint and publishes an event to it, so that the delivery, in flight, waits for the view to read the
    endpoint (up to 30 s here),
    When the worker shuts down, and the view is no longer held back from the moment its drain starts,
    Then the delivery reaches the receiver before the drain ends (before: nothing polled the view while draining,
    so the delivery waited the whole 30 s and failed as `endpoint_view_behind`, to be retried by a later worker;
    a rebalance drained the same way)."""
    api = _hooks(namespace, channel_topics, limits, processes, redis_client, SCALE, worker=False)
    monkeypatch.setattr(delivery_module, "VIEW_SYNC_S", 30.0)
    worker = Runtime.from_env(dispatch_env).worker("webhook", "transactional")
    adapter = worker.routes.primary.adapter
    held_back = threading.Event()
    follow = adapter.directory.poll
    adapter.directory.poll = lambda: None if held_back.is_set() else follow()
    drain = worker._drain

    def drain_following_the_view(*args, **kwargs):
        held_back.clear()
        return drain(*args, **kwargs)

    worker._drain = drain_following_the_view
    stop = threading.Event()
    running = threading.Thread(target=worker.run, kwargs={"until": stop.is_set})
    running.start()
    try:
        wait_until(lambda: adapter.ready and worker.pauses.assigned, 60, "the worker to be assigned and ready")
        held_back.set()
        ep = _register(api, mock_endpoint, "new")
        r = api.post("/v1/sends", json=event(), headers=api.keys["a"])
        assert r.status_code == 202, r.text
        [d] = r.json()["deliveries"]
        assert d["endpoint_id"] == ep["id"]
        wait_until(lambda: len(worker.dispatcher.in_flight) == 1, 30, "the delivery to be in flight")
        assert d["delivery_id"] not in mock_endpoint.stats(deliveries=True)["deliveries"]
    finally:
        stop.set()
        running.join(60)
    assert not running.is_alive()
    assert d["delivery_id"] in mock_endpoint.stats(deliveries=True)["deliveries"]


def test_a_delivery_replayed_alone_whose_publish_is_unconfirmed_is_passed_over_by_a_bulk_replay(
        stack, names, channel_topics, send_client, redis_client, namespace):
    """Given tenant acme's delivered delivery to an active endpoint (its record on the lane, where a replay reads it),
    When acme replays it alone and the broker does not confirm the replay (it may be published),
    Then the answer is 503 `"outcome": "unknown"` naming the replay's id, the delivery's replay is marked pending,
    and a bulk replay over the delivery's range passes it over as already replayed (before: the original stayed
    unmarked and the bulk replay published it again, a second copy for the receiver)."""
    import asyncio

    import httpx
    from fastapi import FastAPI

    from streams.errors import PublishOutcomeUnknown
    from streams.send import build_send, validate_request
    from streams.webhooks.api import webhook_routes
    from streams.webhooks.model import Endpoint

    channel_topics("email")
    endpoint = Endpoint(id="ep_1", tenant="acme", url="https://hooks.example/x", event_types=("*",))
    hooks = SimpleNamespace(endpoints=SimpleNamespace(get=lambda tenant, endpoint_id: endpoint),
                            current=lambda ep: ep)
    store = StatusStore(redis_client, namespace)
    now_ms = int(time.time() * 1000)
    delivered = build_send(validate_request(email_request()), "acme")
    [written] = send_client.publish_sends([delivered])
    store.record_outcome({"send_id": delivered.send_id, "status": "delivered", "tenant_id": "acme",
                          "endpoint_id": "ep_1", "created_at_ms": now_ms - 1000, "completed_at_ms": now_ms,
                          "origin": {"topic": written.topic, "partition": written.partition,
                                     "offset": written.offset}})

    class Unconfirmed:  # the broker neither confirms nor refuses the replay's publish
        def __getattr__(self, name):
            return getattr(send_client, name)

        def publish_sends(self, sends):
            raise PublishOutcomeUnknown("the broker did not confirm the replay (test)")

    app = FastAPI()
    app.include_router(webhook_routes(hooks, store, Unconfirmed(), lambda: "acme"))  # type: ignore[arg-type]

    async def call(method: str, path: str, **request) -> httpx.Response:
        transport = httpx.ASGITransport(app, raise_app_exceptions=True)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as api:
            return await api.request(method, path, **request)

    alone = asyncio.run(call("POST", f"/v1/deliveries/{delivered.send_id}/replay"))
    assert alone.status_code == 503 and "\"outcome\":\"unknown\"" in alone.text, alone.text
    assert store.get(delivered.send_id)["replayed_as"] == "pending"  # a replay left unconfirmed: no id yet
    bulk = asyncio.run(call("POST", "/v1/endpoints/ep_1/replay",
                            json={"since_ms": now_ms - 60_000, "statuses": ["delivered"]}))
    assert bulk.status_code == 202 and bulk.json()["already_replayed"] == 1, bulk.text
