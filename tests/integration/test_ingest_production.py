"""The ingest API as demanding producers and operators use it: sizes that agree end to end,
Idempotency-Key, all-or-nothing batches, per-tenant quotas, API keys with a lifecycle, operator
routes with an audit trail, and OPTIONS that tells the truth."""

import asyncio
import hashlib
import math
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import pytest
from confluent_kafka.admin import AdminClient

from streams.ingest.api import keep_lease
from streams.ingest.api_keys import ApiKeys
from streams.ingest.idempotency import Answered, Claimed, Conflict, IngestIdempotency, OtherRoute, Pending, body_hash
from streams.names import RedisKeys
from streams.send import MAX_SEND_BYTES
from streams.state.guard import restore
from streams.state.log import OperatorLog
from tests.harness import count_records, email_request, free_port, metric_sum, sms_request, start_api, wait_until


@pytest.fixture
def api(stack, namespace, channel_topics, processes, redis_client):
    channel_topics("email")
    return start_api(processes, free_port(), {"a": "tenant-a", "b": "tenant-b"}, redis_client, namespace)


def big_email(size: int) -> dict:
    return email_request(html="<p>" + "x" * size + "</p>")


def test_sizes_agree_end_to_end(api, stack, names):
    """Given the documented maximum send size (1 MiB) and a 5 MiB request limit,
    When a tenant posts a send just under the maximum, one just over it, a batch whose third send is over it,
    and a 6 MiB body sent chunked (no Content-Length),
    Then the first is accepted and reaches its lane whole; the second gets 413 naming the send and leaves no status
    behind; the batch gets 413 naming send 2 and publishes nothing of its other sends; the chunked body gets 413."""
    topic = names.lane("email", "transactional")
    ok = api.post("/v1/sends", json=big_email(MAX_SEND_BYTES - 4096), headers=api.keys["a"])
    assert ok.status_code == 202, ok.text
    assert count_records(stack.bootstrap, topic) == 1

    over = api.post("/v1/sends", json=big_email(MAX_SEND_BYTES + 1024), headers=api.keys["a"])
    assert over.status_code == 413 and over.json()["error"] == "send_too_large"
    assert over.json()["errors"][0]["loc"] == ["body"] and "at most" in over.json()["errors"][0]["msg"]

    batch = api.post("/v1/sends/batch", json={"sends": [email_request(), email_request(),
                                                        big_email(MAX_SEND_BYTES + 1024)]}, headers=api.keys["a"])
    assert batch.status_code == 413 and batch.json()["errors"][0]["loc"] == ["body", "sends", 2]
    assert count_records(stack.bootstrap, topic) == 1  # nothing of the batch

    def chunks():
        for _ in range(6):
            yield b" " * (1024 * 1024)

    chunked = api.post("/v1/sends", content=chunks(), headers={**api.keys["a"], "content-type": "application/json"})
    assert chunked.status_code == 413 and chunked.json()["error"] == "payload_too_large"


def test_the_same_idempotency_key_publishes_once(api, stack, names, redis_client, namespace):
    """Given a tenant retrying a batch of two sends with the same Idempotency-Key,
    When it posts the batch twice, then the same key with a different body, then (while another API process is
    still publishing under it) a third key,
    Then the second answer is the first one again (same send ids, marked as replayed) and nothing more is published;
    the different body gets 422 naming the header; the key in progress gets 409 with Retry-After; another tenant's
    identical key is its own."""
    topic = names.lane("email", "transactional")
    headers = {**api.keys["a"], "Idempotency-Key": "order-42"}
    body = {"sends": [email_request(), email_request()]}
    first = api.post("/v1/sends/batch", json=body, headers=headers)
    again = api.post("/v1/sends/batch", json=body, headers=headers)
    assert first.status_code == again.status_code == 202
    assert again.json() == first.json() and again.headers["idempotent-replayed"] == "true"
    assert count_records(stack.bootstrap, topic) == 2

    other = api.post("/v1/sends/batch", json={"sends": [email_request()]}, headers=headers)
    assert other.status_code == 422 and other.json()["error"] == "idempotency_key_reused"
    assert other.json()["errors"][0]["loc"] == ["header", "Idempotency-Key"]

    single = email_request()
    IngestIdempotency(redis_client, namespace).begin("tenant-a", "in-flight", body_hash(single), "POST /v1/sends")
    busy = api.post("/v1/sends", json=single, headers={**api.keys["a"], "Idempotency-Key": "in-flight"})
    assert busy.status_code == 409 and busy.headers["retry-after"] == "1"

    theirs = api.post("/v1/sends/batch", json=body, headers={**api.keys["b"], "Idempotency-Key": "order-42"})
    assert theirs.status_code == 202 and theirs.json() != first.json()
    assert count_records(stack.bootstrap, topic) == 4


def test_an_idempotency_key_names_one_route(api, stack, names):
    """Given a body valid on both routes (a single send carrying a `sends` field the sends ignore, which is also
    a batch of one), posted to /v1/sends under a key,
    When the same body goes to /v1/sends/batch under the same key,
    Then it is 422 `idempotency_key_reused` naming the route the key was used on, not the single send's answer
    replayed as if it were the batch's (a different shape, read as a batch of nothing); nothing more is
    published, and the first route still replays its answer."""
    topic = names.lane("email", "transactional")
    headers = {**api.keys["a"], "Idempotency-Key": "both-routes"}
    body = {**email_request(), "sends": [email_request()]}
    single = api.post("/v1/sends", json=body, headers=headers)
    assert single.status_code == 202 and count_records(stack.bootstrap, topic) == 1

    batch = api.post("/v1/sends/batch", json=body, headers=headers)

    assert batch.status_code == 422 and batch.json()["error"] == "idempotency_key_reused"
    assert "POST /v1/sends in the last 24 h" in batch.json()["errors"][0]["msg"]
    again = api.post("/v1/sends", json=body, headers=headers)
    assert again.json() == single.json() and again.headers["idempotent-replayed"] == "true"
    assert count_records(stack.bootstrap, topic) == 1


def test_a_key_stored_before_routes_were_kept_answers_on_either_route(redis_client, namespace):
    """A key answered by a version that did not note the route (a retry across an upgrade) still replays its
    answer, on either route; a key that notes one refuses the other, pending or answered."""
    idem, digest = IngestIdempotency(redis_client, namespace), body_hash(email_request())
    claim = idem.begin("tenant-a", "old", digest, "POST /v1/sends")
    assert isinstance(claim, Claimed) and idem.finish("tenant-a", "old", 202, {"id": "1"}, claim.holder)
    assert idem.begin("tenant-a", "old", digest, "POST /v1/sends/batch") == OtherRoute("POST /v1/sends")
    redis_client.hdel(RedisKeys(namespace).ingest_idempotency("tenant-a", "old"), "route")
    assert idem.begin("tenant-a", "old", digest, "POST /v1/sends/batch") == Answered(202, {"id": "1"})

    assert isinstance(idem.begin("tenant-a", "new", digest, "POST /v1/sends/batch"), Claimed)
    assert idem.begin("tenant-a", "new", digest, "POST /v1/sends") == OtherRoute("POST /v1/sends/batch")


def test_a_keyed_body_nested_too_deep_for_a_canonical_form_is_refused_not_a_500(api, stack, names):
    """Given a valid send carrying a field the sends ignore, nested 300 levels deep (past the 254 levels the
    canonical form of a body can hold),
    When it is posted with an Idempotency-Key, twice,
    Then each answer is 422 naming the body, and nothing is published (before: 500 "may have taken effect,
    retry with the same Idempotency-Key", which answered 500 again on every retry)."""
    junk: list = []
    for _ in range(300):
        junk = [junk]
    headers = {**api.keys["a"], "Idempotency-Key": "deep-1"}
    for _ in range(2):
        r = api.post("/v1/sends", json={**email_request(), "junk": junk}, headers=headers)
        assert r.status_code == 422 and r.json()["errors"][0]["loc"] == ["body"], r.text
        assert "nested more than 254 levels" in r.text
    assert count_records(stack.bootstrap, names.lane("email", "transactional")) == 0


def test_a_key_being_published_keeps_its_lease_and_only_its_holder_renews_it(redis_client, namespace):
    """Given a request that claimed an Idempotency-Key with a 1.5 s lease and is still being published,
    When 4.5 s pass while the API renews the lease (three leases' time),
    Then a duplicate still gets `pending` (409), not a second publish; and once renewals stop, the lease
    lapses, a duplicate takes the key over, and the first holder can no longer renew it, free it or
    store its answer under it: the new holder's answer is the one kept."""
    idem = IngestIdempotency(redis_client, namespace, lease_s=1.5)
    digest = body_hash(email_request())
    claim = idem.begin("tenant-a", "slow-batch", digest, "POST /v1/sends")
    assert isinstance(claim, Claimed)

    async def publishing_for(seconds: float) -> None:
        renewing = asyncio.create_task(keep_lease(idem, "tenant-a", "slow-batch", claim.holder))
        await asyncio.sleep(seconds)  # the scenario: a publish this long
        assert not renewing.done()
        renewing.cancel()

    asyncio.run(publishing_for(4.5))
    assert isinstance(idem.begin("tenant-a", "slow-batch", digest, "POST /v1/sends"), Pending)
    def taken_over() -> Claimed | None:
        state = idem.begin("tenant-a", "slow-batch", digest, "POST /v1/sends")
        return state if isinstance(state, Claimed) else None

    taken = wait_until(taken_over, 10, "the lease to lapse", interval=0.1)
    assert taken.holder != claim.holder and taken.first_ms == claim.first_ms  # the same send ids
    assert idem.renew("tenant-a", "slow-batch", claim.holder) is False
    assert idem.renew("tenant-a", "slow-batch", taken.holder) is True
    idem.release("tenant-a", "slow-batch", claim.holder)  # the first request failing late frees nothing
    assert idem.finish("tenant-a", "slow-batch", 202, {"from": "first"}, claim.holder) is False
    assert isinstance(idem.begin("tenant-a", "slow-batch", digest, "POST /v1/sends"), Pending)
    assert idem.finish("tenant-a", "slow-batch", 202, {"from": "second"}, taken.holder) is True
    assert idem.begin("tenant-a", "slow-batch", digest, "POST /v1/sends") == Answered(202, {"from": "second"})


class SkewedClock:
    """An API host whose clock is `offset_s` off: what `time` looks like to the code on it."""

    def __init__(self, offset_s: float):
        self.offset_s = offset_s

    def time(self) -> float:
        return time.time() + self.offset_s


def test_leases_are_timed_by_redis_not_by_hosts_whose_clocks_disagree(redis_client, namespace, monkeypatch):
    """Given a request that claimed an Idempotency-Key (a 60 s lease) on a host whose clock is right,
    When a duplicate reaches a host whose clock runs 5 minutes ahead,
    Then it gets `pending` (409): it does not take over a live lease and publish again beside the first
    request; and a holder whose clock runs 5 minutes behind renews its lease from Redis's now, not into the past."""
    idem = IngestIdempotency(redis_client, namespace, lease_s=60)
    digest = body_hash(email_request())
    claim = idem.begin("tenant-a", "skewed", digest, "POST /v1/sends")
    assert isinstance(claim, Claimed)

    monkeypatch.setattr("streams.ingest.idempotency.time", SkewedClock(+300))
    assert isinstance(idem.begin("tenant-a", "skewed", digest, "POST /v1/sends"), Pending)

    monkeypatch.setattr("streams.ingest.idempotency.time", SkewedClock(-300))
    late = idem.begin("tenant-a", "late-clock", digest, "POST /v1/sends")
    assert isinstance(late, Claimed)
    longer = IngestIdempotency(redis_client, namespace, lease_s=600)  # a renewal that must show
    assert longer.renew("tenant-a", "late-clock", late.holder) is True
    seconds, micros = redis_client.time()
    lease_until = int(redis_client.hget(idem.keys.ingest_idempotency("tenant-a", "late-clock"), "lease_until"))
    assert lease_until - (seconds * 1000 + micros // 1000) > 590_000  # 600 s from Redis's now
    monkeypatch.setattr("streams.ingest.idempotency.time", SkewedClock(0))
    assert isinstance(idem.begin("tenant-a", "late-clock", digest, "POST /v1/sends"), Pending)


def test_a_request_whose_outcome_is_unknown_keeps_its_key_bound_to_its_send_ids(redis_client, namespace):
    """Given a request that claimed an Idempotency-Key and whose publish the broker did not confirm (it may be
    written),
    When its claim lapses the key (and another request's stale claim tries to as well),
    Then the retry with the same body claims the key at once with the same first use (the same send ids), and
    is told an earlier attempt may have published (its own failure is then answered `"outcome": "unknown"`), a
    request with another body under the key gets a conflict (422), and only the holder's lapse counts."""
    idem = IngestIdempotency(redis_client, namespace)
    digest = body_hash(email_request())
    claim = idem.begin("tenant-a", "stalled", digest, "POST /v1/sends")
    assert isinstance(claim, Claimed) and not claim.maybe_published_before
    idem.lapse("tenant-a", "stalled", "not-the-holder")
    assert isinstance(idem.begin("tenant-a", "stalled", digest, "POST /v1/sends"), Pending)

    idem.lapse("tenant-a", "stalled", claim.holder)
    assert isinstance(idem.begin("tenant-a", "stalled", body_hash(sms_request()), "POST /v1/sends"), Conflict)
    retry = idem.begin("tenant-a", "stalled", digest, "POST /v1/sends")
    assert isinstance(retry, Claimed) and retry.first_ms == claim.first_ms and retry.holder != claim.holder
    assert retry.maybe_published_before
    assert isinstance(idem.begin("tenant-a", "stalled", digest, "POST /v1/sends"), Pending)  # the retry holds it now

    # The retry fails with nothing published (a 429, an aborted batch): the key is not freed, or the next
    # retry would publish new send ids next to the first attempt's.
    idem.release("tenant-a", "stalled", retry.holder)
    again = idem.begin("tenant-a", "stalled", digest, "POST /v1/sends")
    assert isinstance(again, Claimed) and again.first_ms == claim.first_ms and again.maybe_published_before


def test_a_key_taken_over_after_its_lease_lapsed_is_never_freed_again(redis_client, namespace):
    """Given a request whose process died while publishing under an Idempotency-Key (its lease lapses),
    When a retry takes the key over and fails with nothing published (say a 429),
    Then the key is not freed: the next retry still claims it with the first attempt's first use (the dead
    process may have published under those send ids)."""
    idem = IngestIdempotency(redis_client, namespace, lease_s=0.2)
    digest = body_hash(email_request())
    dead = idem.begin("tenant-a", "crashed", digest, "POST /v1/sends")
    assert isinstance(dead, Claimed)

    def taken_over() -> Claimed | None:
        state = idem.begin("tenant-a", "crashed", digest, "POST /v1/sends")
        return state if isinstance(state, Claimed) else None

    taken = wait_until(taken_over, 10, "the dead request's lease to lapse", interval=0.05)
    idem.release("tenant-a", "crashed", taken.holder)
    again = idem.begin("tenant-a", "crashed", digest, "POST /v1/sends")
    assert isinstance(again, Claimed) and again.first_ms == dead.first_ms


def test_the_sdk_publishes_an_idempotent_batch_under_the_same_ids(send_client, channel_topics):
    """Given the SDK and an idempotency key,
    When the same batch is published twice under it, and once more rebuilt with content changed (a retry that
    rebuilds its sends, a timestamp in them moved on),
    Then every call returns the same send ids (dispatch delivers each id once: a retry never sends twice)."""
    channel_topics("email")
    first = send_client.publish_batch("tenant-a", [email_request()] * 3, idempotency_key="import-7")
    second = send_client.publish_batch("tenant-a", [email_request()] * 3, idempotency_key="import-7")
    assert first == second and len(set(first)) == 3
    rebuilt = send_client.publish_batch("tenant-a", [email_request(subject="Hello (retried)")] * 3,
                                        idempotency_key="import-7")
    assert rebuilt == first


def test_quotas_refuse_a_tenant_over_its_rate_and_no_one_else(api, limits, stack, names):
    """Given an operator's transactional ingest quota of one send every 2 s (burst 5) per tenant (slow enough that
    the 3 sends' tokens cannot come back while the first batch is answered, however slow the machine),
    When tenant a posts 5 sends, then 3 more at once, and tenant b posts 3,
    Then a's first 5 are accepted, the 3 more get 429 with Retry-After (nothing published), b's 3 are accepted; a
    batch larger than the burst can never pass and gets 422; after Retry-After, a is accepted again."""
    limits.set_provider("ingest-transactional", 1_000_000, 1_000_000)
    limits.set_tenant("ingest-transactional", "*", 0.5, 5)
    topic = names.lane("email", "transactional")
    started = time.monotonic()
    assert api.post("/v1/sends/batch", json={"sends": [email_request()] * 5}, headers=api.keys["a"]).status_code == 202
    over = api.post("/v1/sends/batch", json={"sends": [email_request()] * 3}, headers=api.keys["a"])
    refilled_s = time.monotonic() - started  # at most this long to refill between the two debits
    assert over.status_code == 429 and over.json()["error"] == "quota_exceeded"
    wait_s = int(over.headers["retry-after"])
    assert max(1, math.floor(6 - refilled_s)) <= wait_s <= 6  # 3 tokens at 0.5 a second, less what came back
    assert api.post("/v1/sends/batch", json={"sends": [email_request()] * 3}, headers=api.keys["b"]).status_code == 202
    never = api.post("/v1/sends/batch", json={"sends": [email_request()] * 6}, headers=api.keys["b"])
    assert never.status_code == 422 and never.json()["error"] == "quota_burst_exceeded"
    assert count_records(stack.bootstrap, topic) == 8
    retried = wait_until(lambda: (r := api.post("/v1/sends/batch", json={"sends": [email_request()] * 3},
                                                headers=api.keys["a"])).status_code == 202 and r,
                         wait_s + 10, "tenant a to be admitted again", interval=wait_s)
    assert retried.json()["accepted"] == 3


def test_api_keys_are_rotated_and_revoked_everywhere_within_seconds(api, processes, redis_client, namespace):
    """Given two API processes and an operator key,
    When the operator creates a tenant key, lists keys, rotates it with a 2 s overlap, and revokes the new one,
    Then the list shows ids, roles and last-used times but never a key; the old key works during the overlap and is
    refused after it; the revoked key is refused by both API processes at once."""
    second = start_api(processes, free_port(), {}, redis_client, namespace)
    op = api.keys["operator"]
    created = api.post("/v1/admin/keys", json={"role": "tenant", "tenant": "tenant-c", "label": "billing"}, headers=op)
    assert created.status_code == 201
    key = created.json()["key"]
    tenant_c = {"Authorization": f"Bearer {key}"}
    assert api.get("/v1/sends/nope", headers=tenant_c).status_code == 404  # authenticated, used
    listed = api.get("/v1/admin/keys", params={"tenant": "tenant-c"}, headers=op).json()["keys"]
    assert [k["id"] for k in listed] == [created.json()["id"]] and listed[0]["last_used_ms"]
    assert key not in str(listed)

    rotated = api.post(f"/v1/admin/keys/{created.json()['id']}/rotate", json={"overlap_s": 2}, headers=op)
    assert rotated.status_code == 201
    new = {"Authorization": f"Bearer {rotated.json()['key']}"}
    assert api.get("/v1/sends/nope", headers=tenant_c).status_code == 404  # the old key, in its overlap
    assert second.get("/v1/sends/nope", headers=new).status_code == 404
    wait_until(lambda: api.get("/v1/sends/nope", headers=tenant_c).status_code == 401, 10,
               "the old key to stop working after its overlap", interval=0.5)

    assert api.post(f"/v1/admin/keys/{rotated.json()['id']}/revoke", headers=op).status_code == 200
    assert api.get("/v1/sends/nope", headers=new).status_code == 401
    assert second.get("/v1/sends/nope", headers=new).status_code == 401


def test_a_revocation_landing_in_the_middle_of_a_rotation_is_kept(redis_client, namespace, monkeypatch):
    """Given a tenant key being rotated by one operator process (its record read, not yet written back),
    When another process revokes that key at that moment,
    Then the key stays revoked: the rotation writes its expiry over the revoked record, not over the record it
    had read (before, the revocation was lost and the key worked on until the end of the overlap)."""
    log = SimpleNamespace(puts=[])
    log.put = lambda key, value: log.puts.append((key, value))  # the operator log Redis is rebuilt from
    rotating, revoking = ApiKeys(redis_client, namespace, log), ApiKeys(redis_client, namespace, log)
    token = rotating.create("tenant", "tenant-c")
    key_id = rotating.resolve(token).key_id
    save = ApiKeys._save

    def revoke_first(self, digest, doc, *more):
        if self is rotating and "expires_at_ms" in doc and not revoke_first.done:
            revoke_first.done = True
            assert revoking.revoke(key_id).revoked_at_ms
        return save(self, digest, doc, *more)

    revoke_first.done = False
    monkeypatch.setattr(ApiKeys, "_save", revoke_first)
    new_token, old = rotating.rotate(key_id, overlap_s=3600)
    assert revoke_first.done and old.revoked_at_ms and old.expires_at_ms
    assert rotating.resolve(token) is None and revoking.resolve(token) is None
    assert rotating.resolve(new_token) is not None  # the rotation's new key is its own
    [*_, last] = [value for key, value in log.puts if key == f"apikey/{hashlib.sha256(token.encode()).hexdigest()}"]
    assert last["revoked_at_ms"] and last["expires_at_ms"]  # the log ends as Redis does


def test_operator_routes_refuse_tenants_and_every_change_is_audited(api, stack, dispatch_env):
    """Given a tenant key and an operator key,
    When the tenant calls every /v1/admin route and the operator changes a limit and creates a key,
    Then every tenant call gets 403; each operator change is in the audit trail (who, what, before, after), through
    the API and through `streams audit`; the key itself never appears in the trail."""
    spec = api.get("/openapi.json").json()
    for path, operations in spec["paths"].items():
        if not path.startswith("/v1/admin"):
            continue
        for method in operations:
            url = path.replace("{provider}", "resend").replace("{key_id}", "x").replace("{send_id}", "x") \
                .replace("{endpoint_id}", "x").replace("{tenant}", "x")
            r = api.request(method.upper(), url, json={}, headers=api.keys["a"])
            assert r.status_code == 403, (method, path, r.status_code)
    op = api.keys["operator"]
    started = int(time.time() * 1000)
    assert api.put("/v1/admin/limits/resend", json={"global_rate": 7, "global_burst": 7}, headers=op).status_code == 200
    made = api.post("/v1/admin/keys", json={"role": "tenant", "tenant": "tenant-d"}, headers=op).json()
    trail = api.get("/v1/admin/audit", params={"since_ms": started}, headers=op).json()["entries"]
    limits = next(e for e in trail if e["what"] == "limits/resend")
    assert limits["who"].startswith("key:") and limits["after"]["global_rate"] == 7 and limits["before"] == {}
    assert any(e["what"] == f"apikey/{made['id']}" for e in trail)
    operator_key = api.post("/v1/admin/keys", json={"role": "operator", "tenant": "tenant-d"}, headers=op).json()
    assert operator_key["tenant"] is None  # an operator key has no tenant, whatever the body said
    [entry] = [e for e in api.get("/v1/admin/audit", params={"since_ms": started}, headers=op).json()["entries"]
               if e["what"] == f"apikey/{operator_key['id']}"]
    assert entry["after"]["tenant"] is None
    assert made["key"] not in str(trail)
    out = subprocess.run([sys.executable, "-m", "streams.cli", "audit", "--since-ms", str(started)],
                         env=dispatch_env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "limits/resend" in out.stdout and made["key"] not in out.stdout


def test_operators_set_a_tenants_sender_domains_at_run_time(api, stack, names, redis_client, namespace):
    """Given an API process started without SENDER_DOMAINS (any sender accepted),
    When an operator sets tenant a's sender domains to acme.test, and later removes them,
    Then from the next request a may send from acme.test only, and b (named nowhere) may send no email; after
    the removal any sender is accepted again; both changes are on the audit trail; and the entry is in the
    operator log, from which a Redis rebuild restores it."""
    op, a, b = api.keys["operator"], api.keys["a"], api.keys["b"]
    started = int(time.time() * 1000)
    bad = api.put("/v1/admin/senders/tenant-a", json={"domains": ["acme.test", ".acme.test"]}, headers=op)
    assert bad.status_code == 422 and bad.json()["errors"][0]["loc"] == ["body", "domains"], bad.text
    assert "'.acme.test' (an empty label" in bad.json()["errors"][0]["msg"]
    padded = api.put("/v1/admin/senders/tenant-a", json={"domains": [" acme.test"]}, headers=op)
    assert padded.status_code == 422 and "white space around a domain" in padded.text, padded.text
    r = api.put("/v1/admin/senders/tenant-a", json={"domains": ["ACME.test."]}, headers=op)
    assert r.status_code == 200 and r.json() == {"tenant": "tenant-a", "domains": ["acme.test"]}, r.text
    refused = api.post("/v1/sends", json=email_request(**{"from": "x@other.test"}), headers=a)
    assert refused.status_code == 422 and refused.json()["errors"][0]["loc"] == ["body", "payload", "from"]
    assert "acme.test" in refused.json()["errors"][0]["msg"]
    assert api.post("/v1/sends", json=email_request(**{"from": "A <n@mail.acme.test>"}), headers=a).status_code == 202
    nobody = api.post("/v1/sends", json=email_request(**{"from": "x@other.test"}), headers=b)
    assert nobody.status_code == 422 and "no sender domain" in nobody.json()["errors"][0]["msg"]
    shown = api.get("/v1/admin/senders", headers=op).json()
    assert shown == {"enforced": True, "stored": {"tenant-a": ["acme.test"]}, "setting": {}}

    snapshot = OperatorLog(stack.bootstrap, names.operator).snapshot()
    assert snapshot["senders/tenant-a"] == {"domains": ["acme.test"]}
    redis_client.delete(RedisKeys(namespace).sender_domains)  # lost with Redis's data
    restore(redis_client, RedisKeys(namespace), snapshot)
    assert api.get("/v1/admin/senders", headers=op).json()["stored"] == {"tenant-a": ["acme.test"]}

    assert api.delete("/v1/admin/senders/tenant-a", headers=op).status_code == 200
    assert api.delete("/v1/admin/senders/tenant-a", headers=op).status_code == 404
    assert api.post("/v1/sends", json=email_request(**{"from": "x@other.test"}), headers=b).status_code == 202
    trail = api.get("/v1/admin/audit", params={"since_ms": started}, headers=op).json()["entries"]
    assert [(e["before"], e["after"]) for e in trail if e["what"] == "senders/tenant-a"] == [
        (None, ["acme.test"]), (["acme.test"], None)]


def test_a_change_the_audit_trail_does_not_confirm_stays_applied_and_says_so(api, stack, names):
    """Given the operator API, and an audit trail the broker cannot take records on (its topic is gone),
    When an operator changes a limit, creates a key, sets a tenant's sender domains and removes them,
    Then every change is applied; the limit and the sender domains, which making again records without
    changing more, are answered 503 with `"outcome": "applied"` (not "nothing was changed"); the key, which
    again would be another key, is answered 201 with the key, and the removal, which again would find nothing
    (404, nothing recorded), 200; all are counted in dispatch_audit_records_unconfirmed_total by kind."""
    admin = AdminClient({"bootstrap.servers": stack.bootstrap})
    for f in admin.delete_topics([names.audit]).values():
        f.result()
    op = api.keys["operator"]
    changed = api.put("/v1/admin/limits/resend", json={"global_rate": 9, "global_burst": 9}, headers=op)
    assert changed.status_code == 503 and changed.json()["outcome"] == "applied", changed.text
    assert "make the same change again to record it" in changed.json()["errors"][0]["msg"]
    assert api.get("/v1/admin/limits/resend", headers=op).json()["limits"]["global_rate"] == 9
    made = api.post("/v1/admin/keys", json={"role": "tenant", "tenant": "tenant-e"}, headers=op)
    assert made.status_code == 201, made.text
    assert api.get("/v1/sends/nope", headers={"Authorization": f"Bearer {made.json()['key']}"}).status_code == 404
    # Sender domains: setting again records it (503 "applied"); a removal again would find nothing (done).
    put = api.put("/v1/admin/senders/tenant-e", json={"domains": ["e.test"]}, headers=op)
    assert put.status_code == 503 and put.json()["outcome"] == "applied", put.text
    removed = api.delete("/v1/admin/senders/tenant-e", headers=op)
    assert removed.status_code == 200 and removed.json() == {"tenant": "tenant-e", "domains": ["e.test"]}, removed.text
    assert api.get("/v1/admin/senders", headers=op).json()["stored"] == {}
    exposition = api.get("/metrics/").text
    assert metric_sum(exposition, 'dispatch_audit_records_unconfirmed_total{kind="limits"}') == 1
    assert metric_sum(exposition, 'dispatch_audit_records_unconfirmed_total{kind="apikey"}') == 1
    assert metric_sum(exposition, 'dispatch_audit_records_unconfirmed_total{kind="senders"}') == 2


def test_options_names_every_method_of_a_path(api):
    """Given the limits path, served by a GET and a PUT route,
    When a client asks OPTIONS,
    Then the answer is 204 with Allow naming GET, PUT and OPTIONS."""
    r = api.options("/v1/admin/limits/resend")
    assert r.status_code == 204 and set(r.headers["allow"].split(", ")) == {"GET", "PUT", "OPTIONS"}


def test_error_bodies_have_one_shape(api):
    """Every error answer (401, 403, 404, 413, 422) is {"error": str, "errors": [{"loc": [...], "msg": str}]}."""
    answers = [api.get("/v1/sends/x"), api.get("/v1/admin/keys", headers=api.keys["a"]),
               api.get("/v1/sends/x", headers=api.keys["a"]),
               api.post("/v1/sends", json={"channel": "fax"}, headers=api.keys["a"]),
               api.post("/v1/sends", content=b"{", headers={**api.keys["a"], "content-type": "application/json"}),
               httpx.post(f"{api.base_url}/v1/sends", content=b"x" * (6 * 1024 * 1024), headers=api.keys["a"])]
    assert [a.status_code for a in answers] == [401, 403, 404, 422, 400, 413]
    for a in answers:
        body = a.json()
        assert set(body) == {"error", "errors"} and isinstance(body["error"], str)
        assert all(set(e) == {"loc", "msg"} and isinstance(e["loc"], list) for e in body["errors"])



def test_batches_are_served_by_a_bulk_process_at_a_lower_cpu_priority(api, processes, redis_client, namespace):
    """Given the API (batches forwarded to its bulk process) and a second API process with DUAL_RAIL_INGEST_BULK=off,
    When a tenant posts a batch of 3 and a single send to each,
    Then both answer alike (202, ids, Idempotency-Key replays included, one Date and one Server header); with the bulk
    process, the batch is counted in /metrics/bulk (the bulk process's own metrics) and the single send in /metrics;
    without it, both in /metrics, and /metrics/bulk is 404 (a scrape of it must not count the API's metrics twice)."""
    inline = start_api(processes, free_port(), {}, redis_client, namespace, env={"DUAL_RAIL_INGEST_BULK": "off"})
    sends = "dispatch_ingest_sends_total{"
    for client, bulk in ((api, True), (inline, False)):
        batch = {"sends": [email_request("marketing") for _ in range(3)]}
        headers = {**api.keys["a"], "Idempotency-Key": f"bulk-{bulk}"}
        first = client.post("/v1/sends/batch", json=batch, headers=headers)
        assert first.status_code == 202 and first.json()["accepted"] == 3, first.text
        again = client.post("/v1/sends/batch", json=batch, headers=headers)
        assert again.json() == first.json() and again.headers["idempotent-replayed"] == "true"
        for header in ("date", "server", "content-type", "content-length"):
            assert len(first.headers.get_list(header)) == 1, f"{header}: {first.headers.get_list(header)} (bulk={bulk})"
        assert client.post("/v1/sends", json=email_request(), headers=api.keys["a"]).status_code == 202
        own = client.get("/metrics", follow_redirects=True).text
        if bulk:
            assert metric_sum(client.get("/metrics/bulk").text, sends) == 3
            assert metric_sum(own, sends) == 1
        else:
            assert metric_sum(own, sends) == 4
            missing = client.get("/metrics/bulk")
            assert missing.status_code == 404 and "DUAL_RAIL_INGEST_BULK=off" in missing.text, missing.text


def test_a_key_that_may_have_been_published_is_kept_a_day_from_its_last_attempt(redis_client, namespace):
    """Given a key first used almost 24 h ago (5 s of its day left), whose attempt's outcome turned out unknown
    (its lease ended: `lapse`), and another such key whose claim's lease lapsed (its process died),
    When the first is lapsed, and a retry takes the second over,
    Then each is kept a full day again from that moment (before: both still expired 24 h after the first use, so a
    retry a moment later got new send ids, and whatever the broker wrote of the first attempt was sent twice)."""
    keys = RedisKeys(namespace)
    store = IngestIdempotency(redis_client, namespace, lease_s=0.001)
    digest = body_hash(email_request())
    unknown = store.begin("tenant-a", "answered-unknown", digest, "POST /v1/sends")
    died = store.begin("tenant-a", "process-died", digest, "POST /v1/sends")
    assert isinstance(unknown, Claimed) and isinstance(died, Claimed)
    for key in ("answered-unknown", "process-died"):
        redis_client.expire(keys.ingest_idempotency("tenant-a", key), 5)

    store.lapse("tenant-a", "answered-unknown", unknown.holder)
    wait_until(lambda: redis_client.pttl(keys.ingest_idempotency("tenant-a", "process-died")) < 4_999, 5,
               "the dead process's lease to lapse (1 ms)")
    retry = store.begin("tenant-a", "process-died", digest, "POST /v1/sends")

    assert isinstance(retry, Claimed) and retry.maybe_published_before and retry.first_ms == died.first_ms
    for key in ("answered-unknown", "process-died"):
        assert redis_client.ttl(keys.ingest_idempotency("tenant-a", key)) > 23 * 3600, key
