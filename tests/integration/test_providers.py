"""Providers as data, against two mock providers: short-lived tokens refreshed once on a 401, a key the
provider calls invalid held (not dead-lettered), pacing changed at run time, fallback to the channel's next
provider on named reasons only, and the same evidence and retry behaviour for every provider.

The second SMS provider (`sms-b`: token auth, its own protocol) is a second mock provider process.
Where a test needs it first in line, it runs the workers with its own providers file
(`DUAL_RAIL_PROVIDERS`): changing the order is a data change, not a code change."""

import re
import time

import pytest

from streams.gate.limits import LimitChange
from streams.ingest.status import StatusStore
from streams.providers.registry import DEFAULT_FILE
from streams.retry.dlq import read_all
from tests.harness import committed_lag, email_request, free_port, metric, sms_request, wait_until


def providers_file(tmp_path, sms: list[str]) -> str:
    """The packaged providers.toml with the SMS channel's providers in another order."""
    text = re.sub(r'sms = \[.*\]', "sms = [" + ", ".join(f'"{n}"' for n in sms) + "]", DEFAULT_FILE.read_text())
    path = tmp_path / "providers.toml"
    path.write_text(text)
    return str(path)


def sms_to(number: str) -> dict:
    req = sms_request()
    return {**req, "payload": {**req["payload"], "to": number}}


@pytest.fixture
def sms_lane(channel_topics, limits):
    channel_topics("sms")
    for provider in ("sms", "sms-b"):
        limits.set_provider(provider, 1000, 1000)
        limits.set_tenant(provider, "*", 1000, 1000)
    return limits


def drained(stack, names) -> bool:
    return committed_lag(stack.bootstrap, names.group("sms", "transactional"),
                         names.lane("sms", "transactional")) == 0


def test_a_blast_outlives_many_short_tokens_without_a_failure(stack, names, sms_lane, processes, send_client,
                                                              mock_provider_b, tmp_path):
    """Given the token-authenticated SMS provider first in line, issuing tokens that live 3 s, and a
    bucket of 40 requests a second,
    When 480 SMS are sent (about 12 s: four token lifetimes) and, midway, the provider revokes every token
    it issued (a forced 401),
    Then every send is delivered exactly once; the token endpoint was called about once per lifetime
    (refreshed before expiry, never per request); the forced 401 cost one refresh and one retry of the
    same request, never a failed send."""
    mock_provider_b.configure(token_ttl_s=3)
    sms_lane.set_provider("sms-b", 40, 40)
    processes.worker("sms", "transactional", env={"DUAL_RAIL_PROVIDERS": providers_file(tmp_path, ["sms-b"])})
    started = time.monotonic()
    ids = send_client.publish_batch("shop", [sms_request()] * 480)
    wait_until(lambda: mock_provider_b.stats()["sms_requests"] >= 200, 30, "half the blast")
    mock_provider_b.configure(revoke_tokens=True)
    wait_until(lambda: drained(stack, names), 60, "every send to be delivered", interval=0.5)
    elapsed = time.monotonic() - started
    stats = mock_provider_b.stats(deliveries=True)
    assert set(ids) <= set(stats["deliveries"]) and stats["duplicate_deliveries"] == 0
    assert read_all(stack.bootstrap, names.dlq, timeout_s=2) == []
    lifetimes = elapsed / 3
    print(f"blast {elapsed:.1f} s ({lifetimes:.1f} token lifetimes): {stats['token_requests']} token requests, "
          f"{stats['token_refused_401']} answered 401")
    assert 1 <= stats["token_refused_401"] <= 8  # the requests in flight when the tokens were revoked
    assert lifetimes - 1 <= stats["token_requests"] <= 2 * lifetimes + 2


def test_a_401_that_a_fresh_token_does_not_cure_holds_and_alerts_instead_of_using_up_attempts(
        stack, names, sms_lane, processes, send_client, mock_provider_b, tmp_path):
    """Given the token-authenticated provider first in line refusing every token (its account disabled),
    When an OTP is sent,
    Then the worker refreshes the token and retries once, then holds the provider and raises
    dispatch_provider_auth_failures_total (the ProviderAuthFailing alert) with an evidence line; the send is
    neither dead-lettered nor put on a retry tier; once the account works again it is delivered."""
    mock_provider_b.configure(fault_401_ratio=1.0)
    port = free_port()
    processes.start("worker-sms", "worker", "--channel", "sms", "--lane", "transactional", "--metrics-port",
                    str(port), ready="consuming", env={"DUAL_RAIL_PROVIDERS": providers_file(tmp_path, ["sms-b"]),
                                                       "PROVIDER_AUTH_HOLD_S": "2"})
    [send_id] = send_client.publish_batch("shop", [sms_request()])
    wait_until(lambda: (metric(port, "dispatch_provider_auth_failures_total", provider="sms-b") or 0) >= 1, 30,
               "the auth failure to be counted")
    first = mock_provider_b.stats()
    assert first["token_refused_401"] >= 2 and first["token_requests"] >= 2  # refreshed once, retried once
    assert read_all(stack.bootstrap, names.retry("sms", "transactional", "10s"), timeout_s=2) == []
    mock_provider_b.configure(fault_401_ratio=0.0)
    wait_until(lambda: send_id in mock_provider_b.stats(deliveries=True)["deliveries"], 30, "the delivery")
    assert read_all(stack.bootstrap, names.dlq, timeout_s=2) == []
    assert "provider_auth_failed" in processes.logs()


def _email_worker_with_a_key_refused(channel_topics, limits, processes, mock_provider, refused: str,
                                     hold_s: int) -> int:
    """A transactional email worker where acme sends under a Resend key of its own ("re_acme_own_key") and every
    other tenant under the shared one ("re_test_default"); the provider refuses `refused`. Its metrics port."""
    channel_topics("email")
    limits.set_provider("resend", 100, 100)
    limits.set_tenant("resend", "*", 100, 100)
    mock_provider.configure(revoked_api_keys=refused)
    port = free_port()
    processes.start("worker-email", "worker", "--channel", "email", "--lane", "transactional", "--metrics-port",
                    str(port), ready="consuming", env={"PROVIDER_AUTH_HOLD_S": str(hold_s), "RESEND_API_KEYS":
                                                       '{"*": "re_test_default", "acme": "re_acme_own_key"}'})
    return port


def test_a_tenant_key_the_provider_calls_invalid_holds_that_tenant_instead_of_dead_lettering(
        stack, names, channel_topics, limits, processes, send_client, mock_provider):
    """Given tenant acme sending email under its own Resend key, which the provider answers 403 invalid_api_key
    (Resend's answer for a key deleted from its dashboard), and tenant shop under the shared key,
    When each sends a receipt,
    Then shop's is delivered; acme's is held: counted in dispatch_provider_auth_failures_total (the
    ProviderAuthFailing alert), neither dead-lettered nor put on a retry tier (before: a 403 was `rejected`, and
    the receipt was dead-lettered `permanent_error` at once); once the key works again it is delivered, once."""
    port = _email_worker_with_a_key_refused(channel_topics, limits, processes, mock_provider, "re_acme_own_key",
                                            hold_s=2)
    held = send_client.publish("acme", email_request())
    other = send_client.publish("shop", email_request())
    wait_until(lambda: other in mock_provider.stats(deliveries=True)["deliveries"], 30, "shop's receipt")
    wait_until(lambda: (metric(port, "dispatch_provider_auth_failures_total", provider="resend") or 0) >= 1, 30,
               "the refused key to be counted")
    assert mock_provider.stats()["api_keys_refused_403"] >= 1
    assert held not in mock_provider.stats(deliveries=True)["deliveries"]
    assert read_all(stack.bootstrap, names.dlq, timeout_s=2) == []
    assert read_all(stack.bootstrap, names.retry("email", "transactional", "10s"), timeout_s=2) == []
    mock_provider.configure(revoked_api_keys="")
    wait_until(lambda: held in mock_provider.stats(deliveries=True)["deliveries"], 30, "acme's receipt")
    assert mock_provider.stats()["duplicate_deliveries"] == 0
    assert "provider_auth_failed" in processes.logs()


def test_the_shared_key_refused_holds_tenants_that_send_afterwards_and_not_those_with_their_own_key(
        stack, names, channel_topics, limits, processes, send_client, mock_provider):
    """Given the Resend key every tenant shares refused (403 invalid_api_key) on shop's receipt,
    When, during the hold that follows, tenant later (sharing that key) and then acme (a key of its own) send,
    Then acme's is delivered while later's is not even tried (before: later's queue, empty at the refusal, sent its
    request into the refusal and held everyone anew); once the key works again shop's and later's are delivered,
    each once, and nothing is dead-lettered."""
    _email_worker_with_a_key_refused(channel_topics, limits, processes, mock_provider, "re_test_default", hold_s=8)
    first = send_client.publish("shop", email_request())
    wait_until(lambda: mock_provider.stats()["api_keys_refused_403"] >= 1, 30, "the shared key to be refused")
    later = send_client.publish("later", email_request())
    own = send_client.publish("acme", email_request())
    wait_until(lambda: own in mock_provider.stats(deliveries=True)["deliveries"], 30, "acme's receipt, its own key")
    assert mock_provider.stats()["api_keys_refused_403"] == 1
    mock_provider.configure(revoked_api_keys="")
    wait_until(lambda: {first, later} <= set(mock_provider.stats(deliveries=True)["deliveries"]), 30,
               "the held receipts once the key works")
    assert mock_provider.stats()["duplicate_deliveries"] == 0
    assert read_all(stack.bootstrap, names.dlq, timeout_s=2) == []


def test_pacing_changes_take_effect_without_a_restart(stack, names, sms_lane, processes, send_client, limits,
                                                      mock_provider):
    """Given an SMS worker sending a 600-send blast at its bucket's 60 requests a second,
    When an operator sets the provider's pacing to one request in flight and a 500 ms pause between waves,
    Then within seconds the provider sees at most about two requests a second; when the operator clears it,
    the blast finishes at full speed. Nothing is restarted."""
    limits.set_provider("sms", 60, 60)
    port = free_port()
    processes.worker("sms", "transactional", "--metrics-port", str(port))
    send_client.publish_batch("shop", [sms_request()] * 600)
    wait_until(lambda: mock_provider.stats()["sms_requests"] >= 60, 30, "the blast under way")
    changed = time.monotonic()
    limits.apply("sms", LimitChange(concurrency=1, pause_ms=500))
    wait_until(lambda: metric(port, "dispatch_provider_pacing", provider="sms", setting="pause_ms") == 500, 10,
               "the worker to apply the new pacing")
    print(f"pacing applied {time.monotonic() - changed:.1f} s after the change")
    before = mock_provider.stats()["sms_requests"]
    time.sleep(4)  # a measurement window, not a wait for something to happen
    paced = mock_provider.stats()["sms_requests"] - before
    print(f"paced: {paced} requests in 4 s")
    assert paced <= 10  # 2 a second at most, with a little slack
    limits.apply("sms", LimitChange(concurrency=0, pause_ms=0))
    wait_until(lambda: metric(port, "dispatch_provider_pacing", provider="sms", setting="pause_ms") == 0, 10,
               "the worker to clear the pacing")
    wait_until(lambda: drained(stack, names), 60, "the blast to finish at full speed", interval=0.5)


def test_fallback_happens_once_on_named_reasons_only(stack, names, sms_lane, processes, send_client, mock_provider,
                                                     mock_provider_b, redis_client, namespace):
    """Given the first SMS provider answering 400 unsupported_destination for +44 numbers, 400 invalid_recipient
    (a business rule) for +33 numbers, and 200 without a message id for +49 numbers; the second provider
    also refusing +49 numbers as unsupported,
    When one SMS to each is sent,
    Then +44 is delivered by the second provider (its outcome lists both providers); +33 is dead-lettered by
    the first (permanent, never tried elsewhere); +49 is tried on the second once and then dead-lettered with
    both providers in its DLQ headers: one extra call per send at most, never back."""
    mock_provider.configure(sms_unsupported_prefixes="+44", sms_invalid_prefixes="+33")
    mock_provider.configure(sms_no_id_ratio=0.0)
    mock_provider_b.configure(sms_unsupported_prefixes="+49")
    processes.worker("sms", "transactional")
    processes.retrier("sms", "transactional")
    processes.start("outcome-recorder", "outcome-recorder", ready="outcome recorder consuming")
    uk, fr = send_client.publish_batch("shop", [sms_to("+447700900123"), sms_to("+33612345678")])
    mock_provider.configure(sms_no_id_ratio=1.0)
    [de] = send_client.publish_batch("shop", [sms_to("+4915112345678")])
    store = StatusStore(redis_client, namespace)
    done = {s: wait_until(lambda s=s: (d := store.get(s)) and d["status"] in ("delivered", "dead_lettered") and d,
                          60, f"send {s} to finish") for s in (uk, fr, de)}
    assert (done[uk]["status"], done[uk]["provider"], done[uk]["providers_tried"]) == ("delivered", "sms-b",
                                                                                        "sms,sms-b")
    assert uk in mock_provider_b.stats(deliveries=True)["deliveries"]
    assert (done[fr]["status"], done[fr]["reason"], done[fr]["providers_tried"]) == ("dead_lettered",
                                                                                     "permanent_error", "sms")
    assert (done[de]["status"], done[de]["providers_tried"]) == ("dead_lettered", "sms,sms-b")
    letters = {r.send_id: r for r in read_all(stack.bootstrap, names.dlq, timeout_s=5)}
    assert letters[de].headers["providers_tried"] == "sms,sms-b" and fr in letters
    a, b = mock_provider.stats(), mock_provider_b.stats()
    assert (a["sms_unsupported"], a["sms_invalid"], a["sms_no_id"]) == (1, 1, 1)  # one call each on the first
    assert b["sms_unsupported"] == 1 and b["sms_requests"] == 1  # +49 once, +44 once on the second


def test_during_an_outage_of_the_first_provider_fallback_traffic_is_bounded_by_the_seconds_bucket(
        stack, names, sms_lane, processes, send_client, mock_provider, mock_provider_b):
    """Given the first SMS provider answering 200 without message ids to everything (it takes nothing) and the
    second's bucket at 5 requests a second,
    When 40 SMS are sent,
    Then all 40 are delivered by the second provider, never faster than its bucket allows (at most its burst of 5
    plus 5 a second)."""
    mock_provider.configure(sms_no_id_ratio=1.0)
    sms_lane.set_provider("sms-b", 5, 5)
    processes.worker("sms", "transactional")
    processes.retrier("sms", "transactional")
    ids = send_client.publish_batch("shop", [sms_request()] * 40)
    wait_until(lambda: set(ids) <= set(mock_provider_b.stats(deliveries=True)["deliveries"]), 60,
               "every send to reach the second provider", interval=0.5)
    times = sorted(t for s in ids for t in mock_provider_b.stats(deliveries=True)["deliveries"][s])
    span = times[-1] - times[0]
    print(f"40 fallback sends over {span:.1f} s at the second provider")
    assert span >= (40 - 5) / 5 * 0.9  # the bucket (burst 5, then 5/s) set the pace
    assert mock_provider.stats()["sms_no_id"] == 40


@pytest.mark.parametrize("first", ["sms", "sms-b"])
def test_every_provider_gets_the_same_evidence_and_retries(first, stack, names, sms_lane, processes, send_client,
                                                           mock_provider, mock_provider_b, tmp_path):
    """Given either SMS provider first in line answering 500 to everything,
    When an SMS is sent and the provider recovers after its first failure,
    Then the worker logs one evidence line for the failed attempt (send id, provider, status, duration, redacted
    body), schedules a retry naming the providers tried, and the retry delivers it: the same behaviour for
    both providers (the second carrier is not left without retries)."""
    mock = mock_provider if first == "sms" else mock_provider_b
    mock.configure(fault_5xx_ratio=1.0)
    env = {"DUAL_RAIL_PROVIDERS": providers_file(tmp_path, [first]), "DUAL_RAIL_RETRY_TIME_SCALE": "0.05"}
    processes.worker("sms", "transactional", env=env)
    processes.retrier("sms", "transactional", env=env)
    [send_id] = send_client.publish_batch("shop", [sms_request()])
    wait_until(lambda: mock.stats()["faults_5xx"] >= 1, 20, "the first failure")
    mock.configure(fault_5xx_ratio=0.0)
    wait_until(lambda: send_id in mock.stats(deliveries=True)["deliveries"], 30, "the retried delivery")
    logs = processes.logs()
    failed = [line for line in logs.splitlines() if "attempt_failed" in line and send_id in line]
    assert failed and f"provider={first}" in failed[0] and "status=500" in failed[0] and "duration_s=" in failed[0]
    assert "body=" in failed[0]
    assert any("retry_scheduled" in line and send_id in line and f"providers_tried={first}" in line
               for line in logs.splitlines())


def test_a_refused_connection_is_named_in_the_evidence(stack, names, sms_lane, processes, send_client):
    """Given the SMS provider's base URL pointing at a port nobody listens on,
    When an SMS is sent,
    Then the failed attempt's evidence line names the error class (connection_refused) and its duration."""
    processes.worker("sms", "transactional", env={"SMS_BASE_URL": f"http://127.0.0.1:{free_port()}"})
    [send_id] = send_client.publish_batch("shop", [sms_request()])
    wait_until(lambda: any("attempt_failed" in line and send_id in line for line in processes.logs().splitlines()),
               20, "the failed attempt's evidence")
    line = next(ln for ln in processes.logs().splitlines() if "attempt_failed" in ln and send_id in ln)
    assert "error=connection_refused" in line and "duration_s=" in line
