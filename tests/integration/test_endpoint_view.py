"""The endpoint view that ingest fans out with: a process that acts on a request first brings its view up
to the topics' ends, so it never fans out to an endpoint state older than one another process already
showed the client (the bulk process serves batches while the API process answers `GET /v1/endpoints`)."""

import base64
import contextlib
import threading
import time
import uuid
from collections.abc import Iterator

import orjson
import pytest
import redis
from confluent_kafka import Producer

from streams.errors import ConfigError, StoreUnavailable
from streams.kafka_client import put_acked
from streams.names import RedisKeys
from streams.state.log import OperatorLog
from streams.webhooks.endpoints import (
    MAX_ENDPOINTS_PER_TENANT,
    MAX_PREVIOUS_SECRETS,
    EndpointDirectory,
    EndpointStore,
    EndpointViewBehind,
)
from streams.webhooks.lookups import system_resolver
from streams.webhooks.sealing import Sealer, open_secret
from streams.webhooks.ssrf import UrlPolicy
from tests.harness import wait_until

FOLLOW_EVERY_S = 1.0  # slower than ingest's 0.1 s, so the view would lag without the sync


@contextlib.contextmanager
def followed(directory: EndpointDirectory) -> Iterator[None]:
    """The view polled by a thread of its own every FOLLOW_EVERY_S while the block runs."""
    stop = threading.Event()

    def follow() -> None:
        while not stop.wait(FOLLOW_EVERY_S):
            directory.poll()

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    try:
        yield
    finally:
        stop.set()
        follower.join(10)


def test_a_synced_view_holds_a_state_published_a_moment_before(stack, channel_topics, names):
    """Given a view followed by a thread polling it every second,
    When an endpoint's health is published (acknowledged) and the view is synced right after,
    Then the sync returns once the view holds that state: degraded, then active again after a second
    publication; and a view that nobody polls tells its caller within the time given."""
    channel_topics("webhook")
    directory = EndpointDirectory(stack.bootstrap, names.operator, names.endpoint_state)
    directory.start()
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    with followed(directory):
        assert directory.sync(30.0)
        for state in ("degraded", "active", "degraded"):
            put_acked(producer, names.endpoint_state, b"ep_view", orjson.dumps(
                {"state": state, "reason": "10 consecutive failures", "since_ms": 1}), 10, "a health record")
            assert directory.sync(30.0)
            assert directory.health["ep_view"].state == state

    put_acked(producer, names.endpoint_state, b"ep_view", orjson.dumps({"state": "active"}), 10, "a health record")
    assert directory.sync(0.5) is False  # nobody polls it any more
    assert directory.health["ep_view"].state == "degraded"
    directory.close()


def test_unreadable_records_are_skipped_and_the_rest_of_their_batch_is_applied(stack, channel_topics, names, caplog,
                                                                            redis_client):
    """Given endpoint records on the operator log and health records on notif.endpoint.state, some of
    them unreadable (not JSON, a required field missing, a JSON array, a key that is not UTF-8), all
    fetched in one batch between good ones,
    When a view reads them,
    Then it holds every good record, before and after the bad ones (a record written by a newer
    version, with a field this one does not know, included); a bad record leaves its key as it was;
    each bad record is counted and logged by offset without its value (endpoint records hold signing
    secrets); and reading does not raise (webhook workers poll the view on their own thread). The
    operator log's snapshot (which every worker's Redis-loss guard reads, and restores Redis from)
    skips the entries that are not JSON objects the same way."""
    from streams import metrics
    from streams.names import RedisKeys
    from streams.state.guard import restore
    from streams.webhooks.model import Endpoint, Secret

    channel_topics("webhook")
    producer = Producer({"bootstrap.servers": stack.bootstrap})

    def put(topic: str, key: bytes, value: bytes | None) -> None:
        put_acked(producer, topic, key, value, 10, "a test record")

    def endpoint(ep_id: str, url: str) -> bytes:
        return orjson.dumps(Endpoint(ep_id, "t1", url, ("invoice.paid",), secrets=(Secret("whsec_TOPSECRET"),))
                            .to_doc())

    def unreadable(topic: str) -> float:
        return metrics.STATE_RECORDS_UNREADABLE.labels(topic)._value.get()

    before = (unreadable(names.operator), unreadable(names.endpoint_state))
    put(names.operator, b"endpoint/ep_a", endpoint("ep_a", "https://a.example/hook"))
    put(names.operator, b"endpoint/ep_a", b"{not json whsec_TOPSECRET")            # A keeps its first record
    put(names.operator, b"endpoint/ep_bad", orjson.dumps({"id": "ep_bad", "tenant": "t1"}))  # no url, no types
    put(names.operator, b"members/t1", orjson.dumps(["a list, not an object"]))
    put(names.operator, b"endpoint/\xff\xfe", endpoint("ep_x", "https://x.example/hook"))
    newer = {**orjson.loads(endpoint("ep_b", "https://b.example/hook")), "field_of_a_newer_version": 1}
    put(names.operator, b"endpoint/ep_b", orjson.dumps(newer))
    put(names.operator, b"members/t2", orjson.dumps({"emails": ["ops@t2.example"]}))
    put(names.endpoint_state, b"ep_a", orjson.dumps({"state": "degraded", "reason": "10 consecutive failures"}))
    put(names.endpoint_state, b"ep_b", orjson.dumps([1, 2]))
    put(names.endpoint_state, b"ep_b", orjson.dumps({"state": "degraded", "since_ms": "not a number"}))
    put(names.endpoint_state, b"ep_c", orjson.dumps({"state": "degraded", "since_ms": 5}))

    directory = EndpointDirectory(stack.bootstrap, names.operator, names.endpoint_state)
    directory.start()
    try:
        directory.catch_up(30.0)
        assert sorted(directory.endpoints) == ["ep_a", "ep_b"]
        assert directory.endpoints["ep_a"].url == "https://a.example/hook"
        assert directory.endpoints["ep_b"].url == "https://b.example/hook"
        assert directory.members == {"t2": ("ops@t2.example",)}
        assert directory.get("ep_a").state == "degraded"
        assert "ep_b" not in directory.health and directory.health["ep_c"].since_ms == 5
        assert unreadable(names.operator) - before[0] == 4
        assert unreadable(names.endpoint_state) - before[1] == 2
        skipped = [r.getMessage() for r in caplog.records if "unreadable record" in r.getMessage()]
        assert len(skipped) == 6 and all("offset" in line for line in skipped)
        assert not any("TOPSECRET" in line for line in caplog.messages)
    finally:
        directory.close()

    snapshot = OperatorLog(stack.bootstrap, names.operator).snapshot()
    assert snapshot["endpoint/ep_a"]["url"] == "https://a.example/hook"
    assert "members/t1" not in snapshot and snapshot["members/t2"] == {"emails": ["ops@t2.example"]}
    assert unreadable(names.operator) - before[0] == 4 + 2
    keys = RedisKeys(f"view{uuid.uuid4().hex[:8]}:")
    assert restore(redis_client, keys, snapshot) >= 3
    try:
        assert orjson.loads(redis_client.hget(keys.endpoints("t1"), "ep_b"))["url"] == "https://b.example/hook"
    finally:
        redis_client.delete(keys.endpoints("t1"), keys.members("t2"))


def test_a_tenant_has_at_most_its_endpoints_and_another_tenant_is_not_counted_with_it(redis_client, namespace):
    """Each failing endpoint sends its tenant's members alerts from the platform's sender: a tenant that has
    its 50 endpoints is refused a 51st, with the reason, while another tenant still creates its own."""
    store = EndpointStore(redis_client, namespace, None, UrlPolicy(require_https=False, allow=frozenset({"127.0.0.1"})),
                          system_resolver)
    for i in range(MAX_ENDPOINTS_PER_TENANT):
        store.create("acme", f"http://127.0.0.1:9/hooks/{i}", ["*"])
    with pytest.raises(ConfigError, match=f"at most {MAX_ENDPOINTS_PER_TENANT} webhook endpoints"):
        store.create("acme", "http://127.0.0.1:9/hooks/one-more", ["*"])
    assert len(store.all("acme")) == MAX_ENDPOINTS_PER_TENANT
    store.create("globex", "http://127.0.0.1:9/hooks/0", ["*"])


def test_rotating_again_and_again_keeps_the_newest_secrets_only(redis_client, namespace):
    """Every delivery is signed once per valid secret (an HMAC over a body of up to 1 MiB each, on the worker's
    event loop, which every tenant shares): a tenant rotating its secret 1,000 times in a day would make each
    of its deliveries cost 1,000 signatures. The newest secret and the two before it sign; older ones end."""
    store = EndpointStore(redis_client, namespace, None, UrlPolicy(require_https=False, allow=frozenset({"127.0.0.1"})),
                          system_resolver)
    ep, first = store.create("acme", "http://127.0.0.1:9/hooks/rotating", ["*"])
    secrets = [first] + [store.rotate_secret("acme", ep.id) for _ in range(20)]
    kept = store.get("acme", ep.id).secrets
    assert [s.value for s in kept] == secrets[::-1][:1 + MAX_PREVIOUS_SECRETS] and MAX_PREVIOUS_SECRETS == 2
    assert kept[0].expires_at_ms is None and all(s.expires_at_ms for s in kept[1:])


class OrderedLog:
    """An operator log that keeps what was put, in order (what a rebuild of Redis would read)."""

    def __init__(self):
        self.puts: list[tuple[str, dict | None]] = []

    def put(self, key, value) -> None:
        self.puts.append((key, value))

    def last(self, key):
        return [v for k, v in self.puts if k == key][-1]


@pytest.mark.parametrize("meanwhile", ["disabled", "deleted"])
def test_a_change_landing_in_the_middle_of_another_is_kept(redis_client, namespace, monkeypatch, meanwhile):
    """Given a tenant's PATCH of its endpoint's description that has read the endpoint, not yet written it,
    When the webhook worker disables that endpoint at that moment (its receiver answered 410 Gone), or the
    tenant's other request deletes it,
    Then both changes hold: the description is the new one and the endpoint stays disabled (before, the
    PATCH wrote back the record it had read, and the endpoint was active again), or the endpoint stays
    deleted (the PATCH answers 404); and the operator log, which Redis is rebuilt from, ends with what Redis
    holds (the PATCH's stale record, written there first, is not its last word)."""
    policy = UrlPolicy(require_https=False, allow=frozenset({"127.0.0.1"}))
    log = OrderedLog()
    patching = EndpointStore(redis_client, namespace, log, policy, system_resolver)
    other = EndpointStore(redis_client, namespace, log, policy, system_resolver)
    ep, _ = patching.create("acme", "http://127.0.0.1:9/hooks/gone", ["*"])
    save = EndpointStore._save

    def meddle_first(self, changed, *more):
        if self is patching and not meddle_first.done:
            meddle_first.done = True
            if meanwhile == "disabled":
                assert other.set_state("acme", ep.id, "disabled", "the receiver answered 410 Gone").state == "disabled"
            else:
                assert other.delete("acme", ep.id)
        return save(self, changed, *more)

    meddle_first.done = False
    monkeypatch.setattr(EndpointStore, "_save", meddle_first)
    updated = patching.update("acme", ep.id, description="billing events")
    assert meddle_first.done
    now = other.get("acme", ep.id)
    if meanwhile == "disabled":
        assert (now.description, now.state) == ("billing events", "disabled") and updated == now
        assert orjson.loads(orjson.dumps(log.last(f"endpoint/{ep.id}"))) == orjson.loads(orjson.dumps(now.to_doc()))
    else:
        assert now is None and updated is None
        assert log.last(f"endpoint/{ep.id}") is None


class HookedLog(OrderedLog):
    """One writer's view of a shared operator log, running `before` ahead of this writer's second put (a
    change's put-back after its own record), and `after` once its own deletion is appended."""

    def __init__(self, puts, before=None, after=None):
        self.puts, self.before, self.after, self.mine = puts, before, after, 0

    def put(self, key, value) -> None:
        self.mine += 1
        if self.mine == 2 and self.before is not None:
            self.before()
        self.puts.append((key, value))
        if value is None and self.after is not None:
            self.after()


def test_a_deletion_racing_two_changes_is_the_operator_logs_last_word(redis_client, namespace, monkeypatch):
    """Given a tenant's PATCH (A) that read its endpoint, the webhook worker disabling it meanwhile (B, so A
    loses its compare-and-set and logs B's record back), and the tenant deleting it (C) in between: C's
    deletion is logged before A's put-back of B's record and removed from Redis after A read Redis again,
    When all three are done,
    Then Redis holds no endpoint and the operator log's last word on it is the deletion (before, it was B's
    record, written by A after C's deletion: a rebuild of Redis from the log brought the deleted endpoint back,
    and workers following the log kept delivering to it)."""
    policy = UrlPolicy(require_https=False, allow=frozenset({"127.0.0.1"}))
    puts: list = []
    c_logged, go_c = threading.Event(), threading.Event()
    c = EndpointStore(redis_client, namespace, HookedLog(puts, after=lambda: (c_logged.set(), go_c.wait(10))),
                      policy, system_resolver)
    deleting = threading.Thread(target=lambda: c.delete("acme", ep.id))

    def start_c_and_wait_for_its_log_entry():
        deleting.start()
        assert c_logged.wait(10)

    a = EndpointStore(redis_client, namespace, HookedLog(puts, before=start_c_and_wait_for_its_log_entry),
                      policy, system_resolver)
    b = EndpointStore(redis_client, namespace, HookedLog(puts), policy, system_resolver)
    ep, _ = b.create("acme", "http://127.0.0.1:9/hooks/raced", ["*"])
    save = EndpointStore._save

    def b_first(self, changed, *more):
        if self is a and not b_first.done:
            b_first.done = True
            b.set_state("acme", ep.id, "disabled", "the receiver answered 410 Gone")
        return save(self, changed, *more)

    b_first.done = False
    monkeypatch.setattr(EndpointStore, "_save", b_first)
    a.update("acme", ep.id, description="billing events")
    go_c.set()
    deleting.join(10)
    assert redis_client.hget(RedisKeys(namespace).endpoints("acme"), ep.id) is None
    assert [v for k, v in puts if k == f"endpoint/{ep.id}"][-1] is None


def test_a_change_that_finds_nothing_to_write_still_brings_the_log_up_to_what_redis_holds(redis_client, namespace):
    """Given an endpoint whose operator log says `disabled` while Redis says `active` (a disable whose Redis
    write failed after its log write),
    When the tenant reactivates it (nothing to change in Redis),
    Then the log, which the workers follow, says `active` again (before, nothing was written: workers kept
    skipping the endpoint while the API said it receives deliveries)."""
    policy = UrlPolicy(require_https=False, allow=frozenset({"127.0.0.1"}))
    log = OrderedLog()
    store = EndpointStore(redis_client, namespace, log, policy, system_resolver)
    ep, _ = store.create("acme", "http://127.0.0.1:9/hooks/split", ["*"])
    store.set_state("acme", ep.id, "active", "reactivated")
    log.put(f"endpoint/{ep.id}", {**ep.to_doc(), "state": "disabled"})  # the split
    assert store.set_state("acme", ep.id, "active", "reactivated").state == "active"
    assert log.last(f"endpoint/{ep.id}")["state"] == "active"


def test_a_410_disables_the_url_that_answered_it_only(redis_client, namespace):
    """Given an endpoint whose URL the tenant changed while a delivery to the old one was on its way,
    When the old URL's 410 Gone comes back (the worker's view may not have caught up with the change),
    Then the endpoint stays active; a 410 from its current URL disables it."""
    policy = UrlPolicy(require_https=False, allow=frozenset({"127.0.0.1"}))
    store = EndpointStore(redis_client, namespace, OrderedLog(), policy, system_resolver)
    ep, _ = store.create("acme", "http://127.0.0.1:9/hooks/old", ["*"])
    store.update("acme", ep.id, url="http://127.0.0.1:9/hooks/new")
    kept = store.disable_gone("acme", ep.id, "http://127.0.0.1:9/hooks/old")
    assert (kept.state, kept.url) == ("active", "http://127.0.0.1:9/hooks/new")  # the worker retries the delivery
    assert store.get("acme", ep.id).state == "active"
    assert store.disable_gone("acme", ep.id, "http://127.0.0.1:9/hooks/new").state == "disabled"
    assert store.get("acme", ep.id).state == "disabled"


def test_the_410s_of_deliveries_in_flight_together_disable_the_endpoint_once(redis_client, namespace):
    """Given an endpoint with several deliveries in flight whose receiver starts answering 410 Gone,
    When the worker (on its poll thread) asks to disable it for each 410 in turn,
    Then the first disables it, with its operator-log write; the others find it disabled in one Redis read and
    write nothing (before, each wrote the log again and waited for the broker's acknowledgement)."""
    policy = UrlPolicy(require_https=False, allow=frozenset({"127.0.0.1"}))
    log = OrderedLog()
    store = EndpointStore(redis_client, namespace, log, policy, system_resolver)
    ep, _ = store.create("acme", "http://127.0.0.1:9/hooks/gone", ["*"])
    assert store.disable_gone("acme", ep.id, ep.url).state == "disabled"
    written = len(log.puts)
    for _ in range(5):
        assert store.disable_gone("acme", ep.id, ep.url).state == "disabled"
    assert len(log.puts) == written and log.last(f"endpoint/{ep.id}")["state"] == "disabled"


def test_reseal_moves_every_secret_under_the_first_key(redis_client, namespace):
    """Given an endpoint created before keys were set (its secret in the clear) and one sealed under key `old`,
    When the operator lists a new key first (`new,old`) and re-seals the tenant,
    Then both endpoints' secrets are stored under `new` only and open to the same secrets; a second re-seal
    changes nothing; once `old` is dropped from the keys, everything still opens."""
    policy = UrlPolicy(require_https=False, allow=frozenset({"127.0.0.1"}))
    old = Sealer.parse(f"old:{base64.b64encode(b'o' * 32).decode()}")
    new_first = Sealer.parse(f"new:{base64.b64encode(b'n' * 32).decode()},old:{base64.b64encode(b'o' * 32).decode()}")
    clear, _ = EndpointStore(redis_client, namespace, None, policy, system_resolver).create(
        "acme", "http://127.0.0.1:9/hooks/a", ["*"])
    sealed, _ = EndpointStore(redis_client, namespace, None, policy, system_resolver, old).create(
        "acme", "http://127.0.0.1:9/hooks/b", ["*"])
    secrets = {clear.id: clear.secrets[0].value, sealed.id: open_secret(sealed.secrets[0].value, sealed.id, old)}
    store = EndpointStore(redis_client, namespace, OrderedLog(), policy, system_resolver, new_first)
    assert store.reseal("acme") == 2 and store.reseal("acme") == 0
    new_only = Sealer.parse(f"new:{base64.b64encode(b'n' * 32).decode()}")
    for ep in store.all("acme"):
        [stored] = ep.secrets
        assert stored.value.startswith("sealed:v1:new:")
        assert open_secret(stored.value, ep.id, new_only) == secrets[ep.id]


class HeldLog:
    """An operator log whose writes wait until the test lets them go, so that every create under way
    has passed the bound's check before any of them is written (the interleaving a race needs)."""

    def __init__(self):
        self.waiting = 0
        self.go = threading.Event()
        self.lock = threading.Lock()

    def put(self, key, value) -> None:
        with self.lock:
            self.waiting += 1
        assert self.go.wait(30), "the test never let the writes go"


def test_concurrent_creates_cannot_pass_a_tenants_bound_and_a_dead_creates_place_lapses(redis_client, namespace):
    """Given a tenant with 2 places left of its 50,
    When 8 creates run at once, each passing its check before any is written,
    Then exactly 2 are created and 6 are refused with the reason: the tenant has 50, not 56; and a place
    reserved by a create that died before finishing counts until its deadline, then is free again."""
    policy = UrlPolicy(require_https=False, allow=frozenset({"127.0.0.1"}))
    plain = EndpointStore(redis_client, namespace, None, policy, system_resolver)
    for i in range(MAX_ENDPOINTS_PER_TENANT - 2):
        plain.create("acme", f"http://127.0.0.1:9/hooks/{i}", ["*"])
    log = HeldLog()
    held = EndpointStore(redis_client, namespace, log, policy, system_resolver)
    refused: list[str] = []

    def create(i: int) -> None:
        try:
            held.create("acme", f"http://127.0.0.1:9/hooks/racing-{i}", ["*"])
        except ConfigError as exc:
            refused.append(str(exc))

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    wait_until(lambda: log.waiting + len(refused) == 8, 30, "every create to be refused or about to write")
    log.go.set()
    for t in threads:
        t.join(30)
    assert len(plain.all("acme")) == MAX_ENDPOINTS_PER_TENANT
    assert len(refused) == 6 and all(f"at most {MAX_ENDPOINTS_PER_TENANT}" in r for r in refused)

    keys = RedisKeys(namespace)
    plain.delete("acme", plain.all("acme")[0].id)
    now_ms = int(time.time() * 1000)
    redis_client.zadd(keys.endpoint_reservations("acme"), {"ep_died_under_way": now_ms + 60_000})
    with pytest.raises(ConfigError, match="at most"):
        plain.create("acme", "http://127.0.0.1:9/hooks/while-reserved", ["*"])
    redis_client.zadd(keys.endpoint_reservations("acme"), {"ep_died_under_way": now_ms - 1})
    plain.create("acme", "http://127.0.0.1:9/hooks/after-the-deadline", ["*"])
    assert len(plain.all("acme")) == MAX_ENDPOINTS_PER_TENANT


class RecordingLog:
    """An operator log that keeps what was written to it; writing the endpoint breaks the tenant's Redis
    hash (a string in its place), so the Redis write that follows fails."""

    def __init__(self, redis_client, key: str):
        self.redis, self.key = redis_client, key
        self.writes: list[tuple[str, object]] = []

    def put(self, key, value) -> None:
        self.writes.append((key, value))
        if value is not None:
            self.redis.set(self.key, "not a hash")


def test_a_create_whose_redis_write_fails_is_taken_back_out_of_the_operator_log(redis_client, namespace):
    """Given an endpoint create whose operator-log write succeeds and whose Redis write then fails,
    When the create is refused (the store is unavailable),
    Then the endpoint is taken back out of the operator log (the workers follow the log: they would deliver
    to an endpoint the caller was told does not exist), and its reserved place is given back."""
    keys = RedisKeys(namespace)
    log = RecordingLog(redis_client, keys.endpoints("acme"))
    store = EndpointStore(redis_client, namespace, log, UrlPolicy(require_https=False,
                                                                  allow=frozenset({"127.0.0.1"})), system_resolver)
    with pytest.raises(StoreUnavailable):
        store.create("acme", "http://127.0.0.1:9/hooks/x", ["*"])
    (written, doc), (taken_back, tombstone) = log.writes
    assert written == taken_back and doc is not None and tombstone is None
    assert redis_client.zcard(keys.endpoint_reservations("acme")) == 0


class KeepingLog:
    """An operator log that keeps what was written to it."""

    def __init__(self):
        self.writes: list[tuple[str, object]] = []

    def put(self, key, value) -> None:
        self.writes.append((key, value))


def test_a_change_whose_redis_write_fails_leaves_the_operator_log_with_what_redis_holds(redis_client, namespace):
    """Given an endpoint, then a secret rotation whose operator-log write succeeds and whose Redis write then fails
    (Redis stays unreadable meanwhile),
    When it is refused (the store is unavailable: the caller is told nothing changed),
    Then the operator log, which the workers follow, ends with the endpoint as it was, its first secret (before: the log kept the new secret, the workers signed with a secret the caller never saw,
    and once the old one lapsed every delivery failed its receiver's check)."""
    keys = RedisKeys(namespace)
    kept = KeepingLog()
    store = EndpointStore(redis_client, namespace, kept, UrlPolicy(require_https=False,
                                                                   allow=frozenset({"127.0.0.1"})), system_resolver)
    created, _ = store.create("acme", "http://127.0.0.1:9/hooks/x", ["*"])
    as_stored = orjson.loads(redis_client.hget(keys.endpoints("acme"), created.id))
    store.oplog = RecordingLog(redis_client, keys.endpoints("acme"))  # the next write breaks the hash
    redis_client.delete(keys.endpoints("acme"))
    redis_client.hset(keys.endpoints("acme"), created.id, orjson.dumps(as_stored))

    with pytest.raises(StoreUnavailable):
        store.rotate_secret("acme", created.id)
    (key, rotated), (_, last) = store.oplog.writes
    assert key == f"endpoint/{created.id}" and rotated != as_stored and last == as_stored


def test_a_change_whose_redis_write_fails_logs_what_redis_holds_when_redis_answers_a_read(redis_client, namespace,
                                                                                          monkeypatch):
    """Given an endpoint, then a secret rotation whose operator-log write succeeds and whose Redis write fails,
    while Redis, answering reads, holds another change of the endpoint made meanwhile elsewhere,
    When the rotation is refused,
    Then the operator log ends with what Redis holds, that other change (not the record the rotation read: the log
    never ends on a record older than Redis's)."""
    keys = RedisKeys(namespace)
    store = EndpointStore(redis_client, namespace, KeepingLog(), UrlPolicy(require_https=False,
                                                                           allow=frozenset({"127.0.0.1"})),
                          system_resolver)
    created, _ = store.create("acme", "http://127.0.0.1:9/hooks/x", ["*"])
    as_stored = orjson.loads(redis_client.hget(keys.endpoints("acme"), created.id))
    changed_elsewhere = {**as_stored, "description": "changed meanwhile"}

    def concurrent_change_then_refused(**_):
        redis_client.hset(keys.endpoints("acme"), created.id, orjson.dumps(changed_elsewhere))
        raise redis.ConnectionError("Connection reset by peer (test)")

    monkeypatch.setattr(store, "_set_if_unchanged", concurrent_change_then_refused)
    store.oplog = KeepingLog()
    with pytest.raises(StoreUnavailable):
        store.rotate_secret("acme", created.id)
    (_, rotated), (_, last) = store.oplog.writes
    assert rotated["secrets"] != as_stored["secrets"] and last == changed_elsewhere


def test_the_tenants_with_endpoints_are_read_from_redis(redis_client, namespace):
    """Given endpoints of tenants acme and beta written to Redis only (no operator log, so no view has them), a
    tenant with only a place reserved, a string key where a tenant's endpoints would be, and a tenant of another
    namespace whose name the first namespace's `?` would match as a pattern,
    When an operator's re-seal lists the tenants with endpoints,
    Then it lists acme and beta: not the reservation, the string key, nor the other namespace's tenant."""
    policy = UrlPolicy(require_https=False, allow=frozenset({"127.0.0.1"}))
    store = EndpointStore(redis_client, f"{namespace}?", None, policy, system_resolver)
    other = EndpointStore(redis_client, f"{namespace}x", None, policy, system_resolver)
    store.create("acme", "http://127.0.0.1:9/hooks/a", ["*"])
    store.create("beta", "http://127.0.0.1:9/hooks/b", ["*"])
    other.create("gamma", "http://127.0.0.1:9/hooks/c", ["*"])
    keys = RedisKeys(f"{namespace}?")
    redis_client.zadd(keys.endpoint_reservations("delta"), {"ep_reserved": 1})
    redis_client.set(keys.endpoints("epsilon"), b"not a hash")

    assert store.tenants() == ["acme", "beta"]


def test_an_endpoint_looked_up_by_id_alone_is_found_once_the_view_has_read_it(stack, channel_topics, names,
                                                                               redis_client, namespace):
    """Given a view followed by a thread polling it every second, and an endpoint created (operator log, then
    Redis) right before it is looked up by its id alone (as an operator's reactivation does),
    When it is looked up,
    Then it is found, with its tenant, although the view had not polled since it was created; an id nobody has
    is not found; and a view that nobody polls says it is behind instead of answering "no such endpoint"."""
    channel_topics("webhook")
    directory = EndpointDirectory(stack.bootstrap, names.operator, names.endpoint_state)
    directory.start()
    store = EndpointStore(redis_client, namespace, OperatorLog(stack.bootstrap, names.operator),
                          UrlPolicy(require_https=False, allow=frozenset({"127.0.0.1"})), system_resolver)
    with followed(directory):
        ep, _ = store.create("acme", "http://127.0.0.1:9/hooks/a", ["*"])
        found = directory.find(ep.id, 30.0)
        assert found is not None and (found.id, found.tenant) == (ep.id, "acme")
        assert directory.find("ep_nobody_has", 30.0) is None

    later, _ = store.create("acme", "http://127.0.0.1:9/hooks/b", ["*"])
    with pytest.raises(EndpointViewBehind, match="did not catch up"):
        directory.find(later.id, 0.5)  # nobody polls it any more
