"""The Redis adapters on a three-master Redis Cluster (`REDIS_URL=redis+cluster://...`): every Lua
script runs on one slot, the gate, processed_jobs and the status store give the same answers as on a
single Redis, and a master that goes down fails closed until it is back, its data intact."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis
from redis.cluster import ClusterNode
from redis.crc import key_slot

from streams.dispatch.idempotency import Claim, ProcessedJobs, idempotency_key
from streams.errors import GateUnavailable, StateLost, StoreUnavailable
from streams.gate.gate import RedisGate
from streams.gate.limits import LimitStore
from streams.ingest.api_keys import ApiKeys
from streams.ingest.idempotency import IngestIdempotency
from streams.ingest.status import StatusStore
from streams.names import RedisKeys, TopicNames
from streams.redis_client import ClusterClient, ClusterClientPipeline, cluster_startup, connect
from streams.state.guard import StateGuard, log_epoch, missing_markers, write_epoch, write_markers
from streams.state.log import OperatorLog
from streams.webhooks.endpoints import EndpointStore
from streams.webhooks.lookups import system_resolver
from streams.webhooks.ssrf import UrlPolicy
from tests.harness import wait_until

pytestmark = pytest.mark.cluster

PACKAGE = Path(__file__).resolve().parents[2] / "streams"


# ------------------------------------------------------------------------------------------ helpers
class _RecordingPipeline(ClusterClientPipeline):
    recorder: RecordingClient

    def evalsha(self, sha, numkeys, *keys_and_args):
        self.recorder.record(sha, keys_and_args[:numkeys])
        return super().evalsha(sha, numkeys, *keys_and_args)


class RecordingClient(ClusterClient):
    """The production cluster client, noting where each script was registered and the keys of every call."""

    pipeline_class = _RecordingPipeline

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sites: dict[str, str] = {}               # sha -> the file whose code registered it (the last one)
        self.registrations: list[str] = []            # the file of every registration (a script can have two)
        self.calls: list[tuple[str, tuple]] = []      # (sha, keys)

    def register_script(self, script):
        caller = sys._getframe(1)
        registered = super().register_script(script)
        self.sites[registered.sha] = f"{Path(caller.f_code.co_filename).resolve().relative_to(PACKAGE.parent)}"
        self.registrations.append(self.sites[registered.sha])
        return registered

    def record(self, sha, keys) -> None:
        self.calls.append((sha, tuple(k if isinstance(k, str) else k.decode() for k in keys)))

    def evalsha(self, sha, numkeys, *keys_and_args):
        self.record(sha, keys_and_args[:numkeys])
        return super().evalsha(sha, numkeys, *keys_and_args)

    def pipeline(self, transaction=None, shard_hint=None):
        pipe = super().pipeline(transaction, shard_hint)
        pipe.recorder = self
        return pipe


def registration_sites() -> dict[str, int]:
    """Every `register_script(` call in the package: file -> how many."""
    found: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "redis_client.py":
            continue
        n = len(re.findall(r"\.register_script\(", path.read_text()))
        if n:
            found[str(path.relative_to(PACKAGE.parent))] = n
    return found


def spread(client, keys: list[str]) -> set[str]:
    """The masters (host:port) these keys live on."""
    return {client.get_node_from_key(k).name for k in keys}


def pick_names(client, key_of, candidates, per_node: int = 1) -> list[str]:
    """Names from `candidates` whose keys land on every master (`per_node` each), in a stable order."""
    by_node: dict[str, list[str]] = {}
    for name in candidates:
        by_node.setdefault(client.get_node_from_key(key_of(name)).name, []).append(name)
    assert len(by_node) == 3, f"the candidates cover only {sorted(by_node)}"
    return sorted(n for names in by_node.values() for n in names[:per_node])


# ------------------------------------------------------------------------------------------ tests
def test_every_lua_script_of_the_package_runs_on_one_slot(healthy_redis_cluster):
    """Given every `register_script` call in the package (the gate's, processed_jobs', ingest idempotency's and the
    endpoint store's), on a
    client of the Redis Cluster that notes the keys of every script call,
    When the limit store (a compare-and-set change, a cool-down ended), the gate (acquire, acquire_many, cool_down, refund_many), processed_jobs (claim, claim_many, mark_delivered,
    mark_delivered_many, mark_reconcile, release, mark_tried_many, refresh, note_attempts, restore_mark), ingest
    idempotency (begin, renew, finish, release),
    the endpoint store (create, a compare-and-set change), API keys (a compare-and-set change) and the status store
    (recording an outcome, restoring replay marks, claiming a replay and freeing the claim) run for tenants and providers spread over all three masters,
    Then every registration site was used, every registered script was called, and every call's keys hash to one
    slot: the provider's for the gate, the tenant's for the rest."""
    first, nodes = cluster_startup(healthy_redis_cluster.url)
    recording = RecordingClient(url=first, startup_nodes=[ClusterNode(h, p) for h, p in nodes[1:]], socket_timeout=5)
    ns = f"s{uuid.uuid4().hex[:8]}."
    providers = pick_names(recording, lambda p: f"{ns}dr:{{{p}}}:limits", [f"prov{i}" for i in range(40)])
    tenants = pick_names(recording, lambda t: f"{ns}dr:{{t:{t}}}:lease:x", [f"tenant{i}" for i in range(40)])
    limits = LimitStore(recording, ns)
    for p in providers:
        limits.set_provider(p, 100, 100)
        limits.set_tenant(p, "*", 100, 100)

    gate = RedisGate(recording, ns)
    jobs = ProcessedJobs(recording, ns)
    ingest = IngestIdempotency(recording, ns)
    gate.acquire(providers[0], tenants[0], 1)
    gate.acquire_many([(p, t, 2, True) for p in providers for t in tenants])
    gate.cool_down(providers[1], 0.01)
    limits.clear_cool_down(providers[1])  # read and ended in one step, on the provider's slot
    gate.refund_many([(p, t, 1) for p in providers for t in tenants])
    claims = [Claim(t, idempotency_key([f"{t}-{i}" for i in range(3)]), tuple(f"{t}-{i}" for i in range(3)), "w",
                    "/emails/batch", b"[]") for t in tenants]
    assert jobs.claim_many(claims) == [[]] * len(claims)
    assert jobs.claim([f"{tenants[0]}-9"], "send-x", "w", "/emails", b"{}", tenants[0]) == []
    jobs.refresh([(c.tenant, c.key) for c in claims], "w")
    jobs.mark_delivered(claims[0].tenant, claims[0].send_ids, claims[0].key)
    jobs.mark_delivered_many([(c.tenant, c.send_ids, c.key) for c in claims[1:2]])
    jobs.mark_reconcile(tenants[0], [f"{tenants[0]}-9"], "send-x")
    jobs.release(claims[2].tenant, claims[2].send_ids, claims[2].key, "w", earlier={claims[2].send_ids[0]: 1})
    jobs.mark_tried_many([(t, f"{t}-t", 2) for t in tenants])
    jobs.note_attempts([(c.tenant, c.key, c.send_ids[0], 2) for c in claims])
    assert all(jobs.restore_mark(t, f"{t}-m", "tried:2", 60) for t in tenants)
    jobs.keep_unknown(claims[1].tenant, claims[1].key, "w", claims[1].send_ids)
    # marked delivered above: no record, and its sends no longer carry the claim (settled meanwhile)
    assert jobs.take_over(claims[1].tenant, claims[1].key, "w2", claims[1].send_ids) is None
    assert jobs.claim([f"{tenants[1]}-9"], "send-y", "w", "/emails", b"y", tenants[1]) == []
    jobs.keep_unknown(tenants[1], "send-y", "w", [f"{tenants[1]}-9"])
    assert jobs.take_over(tenants[1], "send-y", "w2", [f"{tenants[1]}-9"]).body == b"y"  # a live record, taken over on the cluster
    claimed = ingest.begin(tenants[1], "key-1", "digest", "POST /v1/sends")
    assert ingest.renew(tenants[1], "key-1", claimed.holder)
    assert ingest.finish(tenants[1], "key-1", 202, {}, claimed.holder)
    ingest.release(tenants[2], "key-2", ingest.begin(tenants[2], "key-2", "digest", "POST /v1/sends").holder)
    endpoints = EndpointStore(recording, ns, None, UrlPolicy(require_https=False, allow=frozenset({"127.0.0.1"})),
                              system_resolver)
    for t in tenants:
        created, _ = endpoints.create(t, "http://127.0.0.1:9/hooks", ["*"])
        assert endpoints.set_state(t, created.id, "disabled", "410").state == "disabled"  # compare-and-set
    assert [len(endpoints.all(t)) for t in tenants] == [1] * len(tenants)
    keys = ApiKeys(recording, ns)
    assert keys.revoke(keys.resolve(keys.create("tenant", tenants[0])).key_id).revoked_at_ms  # compare-and-set
    statuses = StatusStore(recording, ns)
    for t in tenants:  # send ids hashing all over the cluster: each status compared and written in its own slot
        statuses.record_outcome({"send_id": f"{t}-s", "tenant_id": t, "status": "delivered", "attempts": 1})
    assert statuses.get(f"{tenants[0]}-s")["status"] == "delivered"
    assert statuses.restore_replays({f"{t}-s": (f"{t}-r", t) for t in tenants}) == len(tenants)
    write_markers(recording, RedisKeys(ns))  # a replay is claimed beside its slot's epoch marker
    statuses.holds_data = lambda: True  # as the API's: its state guard says Redis holds its data
    assert all(statuses.claim_replay(f"{t}-c") for t in tenants)
    for t in tenants:  # a claim whose replay published nothing, freed in its own slot: claimed again
        statuses.release_replay(f"{t}-c")
    assert all(statuses.claim_replay(f"{t}-c") for t in tenants)

    sites = registration_sites()
    used = {}
    for site in recording.registrations:
        used[site] = used.get(site, 0) + 1
    assert used == sites, (f"register_script calls in the package {sites}, exercised here {used}: a new Lua script "
                           "needs its calls added to this test")
    never_called = {recording.sites[sha] for sha in set(recording.sites) - {sha for sha, _ in recording.calls}}
    assert not never_called, f"scripts registered in {never_called} were never called here"
    for sha, keys in recording.calls:
        slots = {key_slot(k.encode()) for k in keys}
        assert len(slots) == 1, (f"a script registered in {recording.sites[sha]} was called with keys in "
                                 f"{len(slots)} slots: {keys}")
    gate_keys = [k for sha, keys in recording.calls if recording.sites[sha].startswith("streams/gate") for k in keys]
    assert spread(recording, gate_keys) == spread(recording, [f"{ns}dr:{{{p}}}:x" for p in providers])
    assert len(spread(recording, gate_keys)) == 3  # and the calls really went to all three masters


@dataclass(frozen=True, eq=False)
class Adm:
    """An admission as compared across the two servers: the same decision and bucket, and a wait within
    0.25 s (each side measures it at its own moment)."""

    allowed: bool
    short: str
    wait_s: float

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Adm) and (self.allowed, self.short) == (other.allowed, other.short)
                and abs(self.wait_s - other.wait_s) <= 0.25)

    __hash__ = None  # type: ignore[assignment]


def _admission(a) -> Adm | tuple:
    if isinstance(a, Exception):
        return (type(a).__name__, str(a))
    return Adm(a.allowed, a.short, a.wait_s)


def scenario(client, ns: str, providers: list[str], tenants: list[str]) -> list[tuple]:
    """One sequence of gate, processed_jobs and status-store calls; what each answered."""
    out: list[tuple] = []
    limits = LimitStore(client, ns)
    for p in providers:
        limits.set_provider(p, 1, 10, reserve=3)  # refills one token a second: the counts below are exact
        limits.set_tenant(p, "*", 1000, 100)
        limits.set_tenant(p, "small", 2, 2)
    gate = RedisGate(client, ns)
    p0, p1 = providers[0], providers[1]
    out.append(("small takes its burst", _admission(gate.acquire(p0, "small", 2))))
    out.append(("small denied", _admission(gate.acquire(p0, "small", 2))))
    out.append(("marketing takes 7", [_admission(gate.acquire(p0, "big", 1, reserve=True)) for _ in range(7)]))
    out.append(("marketing held by the reserve", _admission(gate.acquire(p0, "big", 1, reserve=True))))
    out.append(("transactional passes", _admission(gate.acquire(p0, "otp", 1))))
    out.append(("many", [_admission(a) for a in gate.acquire_many(
        [(p, t, 3, False) for p in providers for t in tenants]
        + [("unconfigured", tenants[0], 1, False), (p1, "small", 5, False), (p0, "big", 1, True)])]))
    gate.cool_down(p1, 1.5)
    out.append(("cool-down holds", _admission(gate.acquire(p1, tenants[0], 1))))
    gate.cool_down(p1, 0.1)
    out.append(("a shorter cool-down does not shorten it", _admission(gate.acquire(p1, tenants[0], 1))))

    keys = RedisKeys(ns)
    write_markers(client, keys)  # as a state guard writes the epoch: on the cluster, a marker in every slot first
    client.set(keys.epoch, "e1")
    jobs = ProcessedJobs(client, ns, epoch_required=True)
    claims = [Claim(t, idempotency_key([f"{t}-a", f"{t}-b"]), (f"{t}-a", f"{t}-b"), "w1", "/emails/batch",
                    f"body of {t}".encode()) for t in tenants]
    out.append(("claim_many", jobs.claim_many(claims)))
    out.append(("claim_many again: all busy", jobs.claim_many(claims)))
    out.append(("claim overlapping", jobs.claim([f"{tenants[0]}-c", f"{tenants[0]}-b"], "send-c", "w2", "/emails",
                                                b"c", tenants[0])))
    jobs.refresh([(c.tenant, c.key) for c in claims], "w1")
    out.append(("take_over while held", jobs.take_over(claims[0].tenant, claims[0].key, "w2", claims[0].send_ids)))
    jobs.mark_delivered_many([(c.tenant, c.send_ids, c.key) for c in claims[:2]])
    jobs.release(claims[2].tenant, claims[2].send_ids, claims[2].key, "w1", earlier={claims[2].send_ids[1]: 1})
    jobs.mark_tried_many([(t, f"{t}-c", 2) for t in tenants] + [(claims[2].tenant, claims[2].send_ids[1], 3)])
    jobs.keep_unknown(claims[3].tenant, claims[3].key, "w1", claims[3].send_ids)
    out.append(("take_over after an unknown outcome", jobs.take_over(claims[3].tenant, claims[3].key, "w2", claims[3].send_ids)))
    out.append(("status", jobs.status_many([(t, [f"{t}-a", f"{t}-b", f"{t}-c"]) for t in tenants])))
    client.delete(keys.epoch, *keys.epoch_markers())  # the data lost: the epoch and, on the cluster, its markers
    try:
        jobs.claim_many([Claim(t, f"send-{t}-z", (f"{t}-z",), "w1", "/emails", b"z") for t in tenants])
        out.append(("claim_many without the epoch", "claimed"))
    except StateLost:
        out.append(("claim_many without the epoch", ("state lost", jobs.status_many([(t, [f"{t}-z"]) for t in tenants]))))

    store = StatusStore(client, ns)
    sends = [SimpleNamespace(send_id=f"send-{i}", tenant_id=tenants[i % len(tenants)], channel="email",
                             lane="transactional", replay_of=None, created_at_ms=1_000 + i) for i in range(6)]
    store.accepted(sends)
    for i, s in enumerate(sends):
        base = {"send_id": s.send_id, "tenant_id": s.tenant_id, "completed_at_ms": 1000 + i, "provider": "resend",
                "attempts": 1, "attempt": {"n": 1, "status": 429}}
        store.record_outcome({**base, "status": "retrying"})
        if i % 2 == 0:
            store.record_outcome({**base, "status": "delivered", "attempts": 2, "attempt": {"n": 2, "status": 200},
                                  "provider_message_id": f"m-{i}"})
            store.record_outcome({**base, "status": "retrying"})  # late: must not replace delivered
    store.record_outcome({"send_id": "hook-1", "tenant_id": tenants[0], "status": "delivered", "completed_at_ms": 5,
                          "endpoint_id": "ep_1", "event_id": "ev_1", "event_type": "order.paid", "created_at_ms": 4})
    for s in [*sends, SimpleNamespace(send_id="hook-1")]:
        doc = store.get(s.send_id) or {}
        doc.pop("accepted_at_ms", None)
        out.append(("get", s.send_id, sorted(doc.items(), key=lambda kv: kv[0])))
    out.append(("endpoint deliveries", store.endpoint_deliveries("ep_1", tenants[0])))
    out.append(("missing", store.get("send-none")))
    return out


def test_gate_idempotency_and_status_store_answer_alike_on_the_cluster_and_a_single_redis(healthy_redis_cluster,
                                                                                           single_redis_url):
    """Given one sequence of calls: the gate (a tenant's burst, a denial, the marketing reserve, acquire_many over
    every provider and tenant with an unconfigured provider and a cost above a burst, a cool-down and a shorter
    one), processed_jobs (claim_many, the same again, an overlapping claim, refresh, take_over while held,
    mark_delivered_many, release keeping an earlier attempt's mark, mark_tried_many, keep_unknown then take_over,
    status_many, claim_many once the Redis epoch is gone) and the status store (accepted,
    outcomes including a late intermediate one, a webhook delivery, get), with providers and tenants whose keys
    live on all three masters,
    When it runs against the Redis Cluster (REDIS_URL=redis+cluster://...) and against a single Redis,
    Then every answer is the same on both (waits compared to 0.1 s), and the answers are the expected ones."""
    cluster = connect(healthy_redis_cluster.url)
    assert isinstance(cluster, ClusterClient)
    ns = f"s{uuid.uuid4().hex[:8]}."
    providers = pick_names(cluster, lambda p: f"{ns}dr:{{{p}}}:limits", [f"prov{i}" for i in range(40)])
    tenants = pick_names(cluster, lambda t: f"{ns}dr:{{t:{t}}}:lease:x", [f"tenant{i}" for i in range(40)], 2)
    assert len(spread(cluster, [f"{ns}dr:send:{{send-{i}}}" for i in range(6)])) >= 2

    on_cluster = scenario(cluster, ns, providers, tenants)
    on_single = scenario(connect(single_redis_url), ns, providers, tenants)

    assert on_cluster == on_single
    answers = dict((row[0], row[1]) for row in on_cluster if row[0] != "get")
    yes = Adm(True, "", 0.0)
    assert answers["small takes its burst"] == yes
    assert answers["small denied"] == Adm(False, "tenant", 1.0)
    assert answers["marketing takes 7"] == [yes] * 6 + [Adm(False, "global", 1.0)]  # 9 left, 3 of them reserved
    assert answers["marketing held by the reserve"].short == "global"
    assert answers["transactional passes"] == yes
    many = answers["many"]
    assert many[:6] == [yes] * 2 + [Adm(False, "global", 1.0)] * 4  # the first provider had 2 tokens left
    assert many[6:18] == [yes] * 12                                  # the other two: 6 each of a full 10
    assert many[18][0] == "ConfigError" and many[19][0] == "CostExceedsBurst" and many[20].short == "global"
    assert answers["cool-down holds"] == Adm(False, "cooldown", 1.5)
    assert answers["a shorter cool-down does not shorten it"] == Adm(False, "cooldown", 1.5)
    assert answers["claim_many"] == [[]] * 6 and answers["claim_many again: all busy"] == [[0, 1]] * 6
    assert answers["claim overlapping"] == [1]
    assert answers["take_over while held"] is None
    assert answers["claim_many without the epoch"] == ("state lost", [[None]] * 6)  # nothing left claimed
    assert answers["take_over after an unknown outcome"].body == f"body of {tenants[3]}".encode()
    inflight = [f"inflight:{idempotency_key([f'{t}-a', f'{t}-b'])}" for t in tenants]
    # -c: marked tried:2 (free until then); tenant 2's -b: released keeping tried:1, then marked tried:3
    assert answers["status"] == [["delivered", "delivered", "tried:2"]] * 2 + [[None, "tried:3", "tried:2"]] + [
        [inflight[i], inflight[i], "tried:2"] for i in (3, 4, 5)]
    gets = {row[1]: dict(row[2]) for row in on_cluster if row[0] == "get"}
    assert gets["send-0"]["status"] == "delivered" and gets["send-0"]["provider_message_id"] == "m-0"
    assert [a["n"] for a in gets["send-0"]["attempt_history"]] == [1, 2]
    assert gets["send-1"]["status"] == "retrying"
    assert gets["hook-1"]["endpoint_id"] == "ep_1"
    assert answers["endpoint deliveries"] == [("hook-1", 4)] and answers["missing"] is None


def test_the_tenants_with_endpoints_are_listed_from_every_master(healthy_redis_cluster):
    """Given endpoints of tenants whose keys live on all three masters,
    When an operator's re-seal lists the tenants with endpoints,
    Then every tenant is listed (a SCAN of one node would miss two masters' tenants: `endpoints reseal --tenant '*'`
    would skip their endpoints and report success)."""
    cluster = connect(healthy_redis_cluster.url)
    ns = f"s{uuid.uuid4().hex[:8]}."
    tenants = pick_names(cluster, lambda t: RedisKeys(ns).endpoints(t), [f"tenant{i}" for i in range(40)])
    store = EndpointStore(cluster, ns, None, UrlPolicy(require_https=False, allow=frozenset({"127.0.0.1"})),
                          system_resolver)
    for tenant in tenants:
        store.create(tenant, "http://127.0.0.1:9/hook", ["*"])

    assert store.tenants() == tenants


def test_a_master_that_goes_down_fails_closed_and_comes_back_with_its_data(healthy_redis_cluster):
    """Given rate limits and a claim whose keys live on one master, written more than a second before (the
    append-only file is fsynced every second), and a provider whose keys live on another master,
    When that master is killed with SIGKILL, the cluster is waited on past its node timeout, and the master is
    started again,
    Then at once the gate fails closed (GateUnavailable) and processed_jobs raises StoreUnavailable for that master's
    provider and tenant, and to a held worker's probe (which asks every master), while the other provider is still admitted; once the node timeout has passed the whole
    cluster refuses (cluster down: every provider fails closed); and after the restart both providers are admitted
    again and the claim is still there (nothing to re-send)."""
    rc = healthy_redis_cluster
    client = connect(rc.url)
    ns = f"s{uuid.uuid4().hex[:8]}."
    providers = pick_names(client, lambda p: f"{ns}dr:{{{p}}}:limits", [f"prov{i}" for i in range(40)])
    victim_provider, other_provider = providers[0], next(
        p for p in providers if client.get_node_from_key(f"{ns}dr:{{{p}}}:limits").name
        != client.get_node_from_key(f"{ns}dr:{{{providers[0]}}}:limits").name)
    victim = client.get_node_from_key(f"{ns}dr:{{{victim_provider}}}:limits")
    tenant = next(t for t in (f"tenant{i}" for i in range(100))
                  if client.get_node_from_key(f"{ns}dr:{{t:{t}}}:x").name == victim.name)
    limits = LimitStore(client, ns)
    for p in (victim_provider, other_provider):
        limits.set_provider(p, 100, 100)
        limits.set_tenant(p, "*", 100, 100)
    gate, jobs = RedisGate(client, ns), ProcessedJobs(client, ns)
    assert jobs.claim([f"{tenant}-1"], "send-1", "w1", "/emails", b"{}", tenant) == []
    time.sleep(1.2)  # past the append-only file's once-a-second fsync
    index = victim.port - rc.base_port + 1

    rc.stop_node(index, signal.SIGKILL)
    try:
        with pytest.raises(GateUnavailable, match="failing closed"):
            gate.acquire(victim_provider, tenant, 1)
        with pytest.raises(StoreUnavailable):
            jobs.status(tenant, [f"{tenant}-1"])
        with pytest.raises(StoreUnavailable):  # a held worker's probe asks every master, not one node
            jobs.ping()
        assert gate.acquire(other_provider, tenant, 1).allowed

        def refused() -> bool:
            try:
                gate.acquire(other_provider, tenant, 1)
                return False
            except GateUnavailable:
                return True

        wait_until(refused, 30, "the cluster to be down as a whole (past cluster-node-timeout)", interval=0.5)
    finally:
        rc.start_node(index)

    assert gate.acquire(victim_provider, tenant, 1).allowed
    assert gate.acquire(other_provider, tenant, 1).allowed
    assert jobs.status(tenant, [f"{tenant}-1"]) == ["inflight:send-1"]


def test_a_master_that_stops_answering_fails_a_call_in_one_timeout_and_runs_it_once(healthy_redis_cluster):
    """Given a provider whose keys live on one master, and three tenants with 100 tokens each (refilling a token in
    100 s),
    When that master stops answering (SIGSTOP, as a host cut off) while the gate debits 30 tokens: of one tenant
    in a call of its own, of the second in a round of two (one pipeline, as dispatch asks), and the master answers
    again 6 s after each stop (SIGCONT),
    Then each call fails closed within one socket timeout and a slot-map read (under 12 s; redis-py's ten retries
    took 55 s a call), and no debit ran twice: each tenant has 70 tokens or more left (100 if the master dropped the
    call with its closed connection, 70 if it ran it once; a second run of the script would leave 40)."""
    rc = healthy_redis_cluster
    client = connect(rc.url)
    ns = f"s{uuid.uuid4().hex[:8]}."
    provider = pick_names(client, lambda p: f"{ns}dr:{{{p}}}:limits", [f"prov{i}" for i in range(40)])[0]
    victim = client.get_node_from_key(f"{ns}dr:{{{provider}}}:limits")
    limits = LimitStore(client, ns)
    limits.set_provider(provider, 1000, 1000)
    limits.set_tenant(provider, "*", 0.01, 100)
    gate = RedisGate(client, ns)
    pid = rc.procs[victim.port - rc.base_port + 1].pid()

    def stalled(call) -> float:
        os.kill(pid, signal.SIGSTOP)
        resume = threading.Timer(6.0, os.kill, (pid, signal.SIGCONT))
        resume.start()
        started = time.monotonic()
        try:
            call()
        finally:
            elapsed = time.monotonic() - started
            resume.join()
        return elapsed

    def single() -> None:
        with pytest.raises(GateUnavailable, match="failing closed"):
            gate.acquire(provider, "alone", 30)

    def round_of_two() -> None:
        with pytest.raises(GateUnavailable, match="failing closed"):
            gate.acquire_many([(provider, "first", 30, False), (provider, "second", 30, False)])

    assert stalled(single) < 12.0
    assert stalled(round_of_two) < 12.0
    rc.wait_ok()
    for tenant in ("alone", "first", "second"):
        assert gate.acquire(provider, tenant, 70).allowed, f"{tenant}'s debit ran twice"


def test_a_master_that_loses_its_data_holds_dispatch_though_the_epoch_lives_on_another(healthy_redis_cluster, stack,
                                                                                       create_topics):
    """Given a Redis Cluster whose epoch a state guard wrote (with a marker in every hash slot), and a tenant whose
    sends live on another master than the epoch, with one send delivered,
    When that master loses its data (FLUSHALL: as a master restarted without persistence) while the epoch's master
    keeps it,
    Then the delivered send reads free there, but a claim of it (in one round with a tenant on an intact master)
    raises StateLost and leaves nothing claimed on either master; the worker's guard, asked to look again, holds,
    and so does another role's guard at its next periodic look; and after the epoch is written again (as
    `streams state recover` ends) they resume and the claim goes through."""
    client, ns, keys, oplog = _deployment(healthy_redis_cluster, stack, create_topics)
    guard = StateGuard(client, keys, oplog, "test")
    assert guard.check()                                  # a new deployment: the guard writes the epoch
    assert missing_markers(client, keys) == 0
    bystander = StateGuard(client, keys, oplog, "ingest")  # another role, which only looks every 5 s
    assert bystander.check()

    epoch_node = client.get_node_from_key(keys.epoch).name
    by_node: dict[str, str] = {}
    for t in (f"tenant{i}" for i in range(100)):
        by_node.setdefault(client.get_node_from_key(keys.processed(t, "x")).name, t)
    victim_node = next(n for n in by_node if n != epoch_node)
    victim, intact = by_node[victim_node], next(t for n, t in by_node.items() if n != victim_node)
    jobs = ProcessedJobs(client, ns, epoch_required=True)
    assert jobs.claim([f"{victim}-1"], "send-v1", "w1", "/emails", b"{}", victim) == []
    jobs.mark_delivered(victim, [f"{victim}-1"], "send-v1")

    host, port = victim_node.rsplit(":", 1)
    redis.Redis(host=host, port=int(port)).flushall()
    assert client.get(keys.epoch) is not None             # the epoch's master kept its data
    assert jobs.status(victim, [f"{victim}-1"]) == [None]  # the delivered mark is gone: the send looks free

    with pytest.raises(StateLost, match=victim):
        jobs.claim_many([Claim(intact, f"send-{intact}-1", (f"{intact}-1",), "w1", "/emails", b"a"),
                         Claim(victim, "send-v1-again", (f"{victim}-1",), "w1", "/emails", b"b")])
    assert jobs.status_many([(intact, [f"{intact}-1"]), (victim, [f"{victim}-1"])]) == [[None], [None]]
    guard.recheck()
    assert not guard.check()                              # every slot's marker read: that master's are missing
    assert not bystander.check(force=True)                # a role that claims nothing sees it at its next look

    write_epoch(client, keys, oplog, log_epoch(oplog.snapshot()))
    assert guard.check(force=True) and bystander.check(force=True)
    assert jobs.claim([f"{victim}-2"], "send-v2", "w1", "/emails", b"{}", victim) == []


def test_a_deployment_from_before_the_markers_gets_them_once_and_dispatches(healthy_redis_cluster, stack,
                                                                            create_topics):
    """Given a Redis Cluster and operator log whose epoch was written before the hash-slot markers existed (the log's
    entry says nothing of them, and no slot has one),
    When a state guard of this version starts there,
    Then it finds Redis intact, writes every slot's marker and records them in the log, and a claim that reads its
    slot's marker goes through (an upgrade neither holds dispatch nor makes every claim fail); and when the log's
    entry later loses that record (an older version's tool wrote it) while a master other than the epoch's lost
    its data, a new guard holds instead of writing the missing markers again, unless the log records that a role
    set out to write them (an adoption stopped part-way is finished, not taken for a loss)."""
    client, ns, keys, oplog = _deployment(healthy_redis_cluster, stack, create_topics)
    client.set(keys.epoch, "e-old")
    oplog.put("epoch", {"epoch": "e-old"})
    assert missing_markers(client, keys) == 16384

    assert StateGuard(client, keys, oplog, "test").check()
    assert missing_markers(client, keys) == 0
    assert oplog.snapshot()["epoch"] == {"epoch": "e-old", "markers": True}
    assert StateGuard(client, keys, oplog, "another role").check()
    assert ProcessedJobs(client, ns, epoch_required=True).claim(["s1"], "send-s1", "w", "/emails", b"{}", "t") == []

    # A tool of the older version (a rollback, a rolling upgrade) writes the epoch's entry again, without the
    # markers; then a master other than the epoch's loses its data. A guard must not take the slots left without
    # a marker for a deployment from before them and write them again: it holds.
    oplog.put("epoch", {"epoch": "e-old"})
    victim = next(n for n in {client.get_node_from_key(m).name for m in keys.epoch_markers()[::512]}
                  if n != client.get_node_from_key(keys.epoch).name)
    host, port = victim.rsplit(":", 1)
    redis.Redis(host=host, port=int(port)).flushall()
    assert 0 < missing_markers(client, keys) < 16384
    assert not StateGuard(client, keys, oplog, "a third role").check()
    assert 0 < missing_markers(client, keys) < 16384

    # The same slots without their marker, where the log records that a role set out to write them (it stopped
    # part-way, or is still writing): not a loss; a new guard writes the rest and dispatches.
    oplog.put("epoch", {"epoch": "e-old", "markers": "writing"})
    assert StateGuard(client, keys, oplog, "a fourth role").check()
    assert missing_markers(client, keys) == 0
    assert oplog.snapshot()["epoch"] == {"epoch": "e-old", "markers": True}


def test_slots_a_master_was_given_empty_later_are_seen_by_a_role_that_claims_nothing(healthy_redis_cluster, stack,
                                                                                       create_topics):
    """Given a Redis Cluster whose epoch a state guard wrote (a marker in every hash slot), and a role that claims
    nothing (it only looks every 5 s),
    When ten slots in the middle of a master's range lose their markers (what slots given to a master empty, after
    a shard died, look like: its first slot keeps its marker),
    Then within one sweep of all slots (128 looks, about 11 minutes at one look every 5 s) that role's look finds them
    and it holds; once the epoch is written again it resumes."""
    client, ns, keys, oplog = _deployment(healthy_redis_cluster, stack, create_topics)
    assert StateGuard(client, keys, oplog, "worker").check()  # writes the epoch and every marker
    role = StateGuard(client, keys, oplog, "ingest")
    assert role.check()                                       # its first check reads every marker

    owner = client.nodes_manager.slots_cache[6000][0].name
    first = min(s for s, nodes in client.nodes_manager.slots_cache.items() if nodes[0].name == owner)
    assert first < 6000
    client.delete(*(keys.epoch_marker(slot) for slot in range(6000, 6010)))

    looks = 0
    while role.check(force=True):
        looks += 1
        assert looks < 128, "a whole sweep of the slots did not find the missing markers"
    assert role.lost and missing_markers(client, keys) == 10
    write_epoch(client, keys, oplog, log_epoch(oplog.snapshot()))
    assert role.check(force=True)


def test_operator_state_of_a_second_master_lost_during_the_hold_comes_back_and_a_deletion_stays(
        healthy_redis_cluster, stack, create_topics):
    """Given a Redis Cluster with one endpoint for each of many tenants (spread over all three masters), each in the
    operator log,
    When one master loses its data (a guard holds and restores), a tenant whose endpoint is on another master then
    deletes it, and then that other master loses its data too, before anyone recovers,
    Then the next look of a guard restores the second master's endpoints too (each slot carries its own
    `restored` marker, lost with its data: one marker for the whole deployment, living on an intact master, would
    have left them gone for good, since recover does not restore), while the endpoint deleted after the first
    restore stays deleted."""
    client, ns, keys, oplog = _deployment(healthy_redis_cluster, stack, create_topics)
    guard = StateGuard(client, keys, oplog, "test")
    assert guard.check()
    endpoints = EndpointStore(client, ns, oplog, UrlPolicy(require_https=False, allow=frozenset({"127.0.0.1"})),
                              system_resolver)
    by_node: dict[str, list[tuple[str, str]]] = {}
    for t in (f"tenant{i}" for i in range(30)):
        created, _ = endpoints.create(t, "http://127.0.0.1:9/hooks", ["*"])
        by_node.setdefault(client.get_node_from_key(keys.endpoints(t)).name, []).append((t, created.id))
    first, second = [n for n in by_node if n != client.get_node_from_key(keys.epoch).name][:2]

    def flush(node: str) -> None:
        host, port = node.rsplit(":", 1)
        redis.Redis(host=host, port=int(port)).flushall()

    flush(first)
    guard.recheck()
    assert not guard.check()
    assert all(endpoints.get(t, e) for t, e in by_node[first])  # restored
    deleted_tenant, deleted = by_node[second][0]
    assert endpoints.delete(deleted_tenant, deleted)

    flush(second)
    assert not guard.check(force=True)
    assert all(endpoints.get(t, e) for t, e in by_node[second][1:])
    assert endpoints.get(deleted_tenant, deleted) is None
    assert all(endpoints.get(t, e) for t, e in by_node[first])


def _deployment(cluster, stack, create_topics) -> tuple:
    """A client of the cluster, a namespace of the test's own, its Redis keys and its operator log."""
    client = connect(cluster.url)
    ns = f"s{uuid.uuid4().hex[:8]}."
    create_topics({TopicNames(ns).operator: 1}, {"cleanup.policy": "compact"})
    return client, ns, RedisKeys(ns), OperatorLog(stack.bootstrap, TopicNames(ns).operator)
