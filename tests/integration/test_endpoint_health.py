"""Endpoint health end to end: the faust-streaming app (`streams endpoint-health`, a real process)
over the real broker, webhook workers delivering to the mock receiver, alert emails through our own
email transactional lane to the mock provider, and ingest following the published state.

Retry tiers are scaled so that no retry comes due while a test counts failures: the counts are the
ones each test makes happen."""

import signal
import time

import orjson
import pytest
from confluent_kafka.admin import AdminClient

from streams.health.rules import DEGRADE_AFTER
from streams.ingest.status import StatusStore
from streams.lag.reader import LagReader
from tests.harness import (
    committed_lag,
    committed_messages,
    final_delivery,
    free_port,
    metric,
    metric_sum,
    read_topic,
    register_endpoint,
    start_api,
    wait_until,
    webhook_event,
)

MEMBERS = ["owner@tenant-a.test", "Ops <ops@tenant-a.test>"]
ALERTS = "dual-rail"


class Rig:
    """The processes of one test, started with the retry time scale the test needs."""

    def __init__(self, processes, mock_endpoint, mock_provider, redis_client, namespace):
        self.processes, self.receiver, self.provider = processes, mock_endpoint, mock_provider
        self.redis, self.namespace = redis_client, namespace
        self.health_ports: list[int] = []

    def start(self, scale: float, health: bool = True, api_env: dict | None = None, tenants: dict | None = None):
        p = self.processes
        p.env["DUAL_RAIL_RETRY_TIME_SCALE"] = str(scale)
        p.env.update(api_env or {})
        p.start("webhook-worker", "worker", "--channel", "webhook", "--lane", "transactional", ready="consuming")
        p.retrier("webhook", "transactional")
        p.start("outcome-recorder", "outcome-recorder", ready="outcome recorder consuming")
        p.start("email-worker", "worker", "--channel", "email", "--lane", "transactional", ready="consuming")
        if health:
            self.start_health()
        self.api = start_api(p, free_port(), tenants or {"a": "tenant-a", "b": "tenant-b"}, self.redis, self.namespace)
        self.api.store = StatusStore(self.redis, self.namespace)
        r = self.api.put("/v1/members", json={"emails": MEMBERS}, headers=self.api.keys["a"])
        assert r.status_code == 200, r.text
        return self.api

    def start_health(self, name: str = "endpoint-health"):
        port = free_port()
        self.health_ports.append(port)
        # faust's own INFO lines (assignments, table recovery) are in the logs a failing test shows.
        return self.processes.start(name, "endpoint-health", "--metrics-port", str(port),
                                    ready="endpoint health consuming", env={"LOG_LEVEL": "INFO"})

    def kill(self, name: str) -> None:
        """kill -9 one process by name."""
        [proc] = [m.proc for m in self.processes.members if m.name == name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    # ---- what users see
    def register(self, name: str, **behaviour) -> dict:
        return register_endpoint(self.api, self.receiver, name, **behaviour)

    def publish(self, n: int, who: str = "a") -> list[dict]:
        """n invoice.paid events of tenant `who` in one batch; their deliveries (one per subscribed endpoint)."""
        body = self.api.post("/v1/sends/batch", json={"sends": [webhook_event()] * n}, headers=self.api.keys[who])
        assert body.status_code == 202, body.text
        return [d for s in body.json()["sends"] for d in s["deliveries"]]

    def failed(self, name: str) -> int:
        return self.receiver.stats()["endpoints"].get(name, {}).get("failed", 0)

    def wait_failed(self, name: str, n: int) -> None:
        wait_until(lambda: self.failed(name) >= n, 30, f"{n} failed attempts at {name}")

    def applied(self, port: int | None = None) -> float:
        """Attempt events the endpoint-health copies have applied."""
        return sum(metric(p, "webhook_endpoint_health_events_total", kind="attempt") or 0
                   for p in ([port] if port else self.health_ports))

    def wait_applied(self, n: int, port: int | None = None) -> None:
        wait_until(lambda: self.applied(port) >= n, 60, f"endpoint health to apply {n} attempts")

    def wait_committed(self, stack, names) -> None:
        """The endpoint-health group has committed every attempt event it read."""
        wait_until(lambda: committed_lag(stack.bootstrap, names.endpoint_health_app, names.webhook_attempts) == 0,
                   30, "endpoint health to commit what it applied")

    def state(self, ep: dict, who: str = "a") -> str:
        return self.api.get(f"/v1/endpoints/{ep['id']}", headers=self.api.keys[who]).json()["state"]

    def wait_state(self, ep: dict, state: str, timeout: float = 30) -> float:
        wait_until(lambda: self.state(ep) == state, timeout, f"endpoint {ep['id']} to be {state}", interval=0.05)
        return time.time()

    def alerts(self) -> list[dict]:
        return [m for m in self.provider.emails() if m["tenant"] == ALERTS]


def skipped_at_ingest(api, reason: str) -> float:
    """webhook_deliveries_skipped_total of ingest's bulk process (it serves batches) for `reason`."""
    text = api.get("/metrics/bulk").text
    return metric_sum(text, f'webhook_deliveries_skipped_total{{reason="{reason}",where="ingest"}}')


def late_dropped_attempt(stack, names, endpoint_id: str) -> None:
    """The attempt event a worker writes when an attempt in flight comes back failed and its delivery is dropped
    (produced here directly)."""
    from confluent_kafka import Producer

    late = {"kind": "attempt", "delivery_id": "late-1", "tenant_id": "tenant-a", "endpoint_id": endpoint_id,
            "n": 9, "at_ms": int(time.time() * 1000), "status_code": 500, "outcome": "unavailable",
            "error": "http_500", "dropped": True}
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    producer.produce(names.webhook_attempts, key=endpoint_id.encode(), value=orjson.dumps(late))
    assert producer.flush(10) == 0


@pytest.fixture
def rig(stack, namespace, channel_topics, limits, processes, redis_client, mock_endpoint, mock_provider):
    channel_topics("webhook")
    channel_topics("email")
    limits.set_provider("webhook", 10_000, 10_000)
    limits.set_tenant("webhook", "*", 10_000, 1_000)
    limits.set_provider("resend", 100, 100)
    limits.set_tenant("resend", "*", 100, 100)
    yield Rig(processes, mock_endpoint, mock_provider, redis_client, namespace)
    processes.stop()
    admin = AdminClient({"bootstrap.servers": stack.bootstrap})  # the app's own changelog and assignor topics
    leftovers = [t for t in admin.list_topics(timeout=10).topics if t.startswith(f"{namespace}endpoint-health")]
    if leftovers:
        for f in admin.delete_topics(leftovers).values():
            f.result()


def test_a_success_resets_the_count_and_the_tenth_consecutive_failure_stops_all_sending(rig, stack, names):
    """Given an endpoint answering 500, with members on the project,
    When 9 deliveries fail, one succeeds, 9 fail again, then one more fails,
    Then it stays active through the first 19 failures (the success reset the count), becomes degraded at
    exactly the tenth consecutive failure, and ingest sees it within 5 s of its publication; from then on
    nothing reaches it: new events are recorded as skipped (endpoint_degraded) in its delivery list, the
    deliveries waiting in retry tiers are skipped when due, and one "Webhook delivery stopped" email
    names the endpoint, the project and the last error."""
    api = rig.start(scale=4.0)  # the first retries come due after 32 s, after this test's counting however loaded
    ep = rig.register("flaky", status=500)
    first = rig.publish(9)
    rig.wait_failed("flaky", 9)
    rig.receiver.configure("flaky", status=200)
    [ok] = rig.publish(1)
    assert final_delivery(api, ok["delivery_id"])["status"] == "delivered"
    rig.receiver.configure("flaky", status=500)
    second = rig.publish(9)
    rig.wait_failed("flaky", 18)
    rig.wait_applied(19)
    assert rig.state(ep) == "active"  # 9 consecutive: not yet

    [tenth] = rig.publish(1)
    seen = rig.wait_state(ep, "degraded")
    assert rig.failed("flaky") == 18 + 1
    [published] = read_topic(stack.bootstrap, names.endpoint_state, 1)
    assert orjson.loads(published.value())["state"] == "degraded"
    lag_s = seen - published.timestamp()[1] / 1000
    print(f"ingest showed the degraded state {lag_s:.2f} s after its publication")
    assert lag_s < 5.0  # ingest follows the state topic: a poll, not a restart (a loaded CI machine adds seconds)

    after = rig.publish(3)
    assert [d["skipped"] for d in after] == ["endpoint_degraded"] * 3
    assert skipped_at_ingest(api, "endpoint_degraded") == 3  # batches: counted by the bulk process
    for d in after:
        done = final_delivery(api, d["delivery_id"])
        assert (done["status"], done["reason"]) == ("skipped", "endpoint_degraded")
    listed = api.get(f"/v1/endpoints/{ep['id']}/deliveries", headers=api.keys["a"]).json()["deliveries"]
    assert {d["delivery_id"] for d in after} <= {d["delivery_id"] for d in listed}
    for d in first + second + [tenth]:  # in retry tiers: skipped when due (up to 48 s), never attempted
        done = final_delivery(api, d["delivery_id"], timeout=120)
        assert (done["status"], done["reason"]) == ("skipped", "endpoint_degraded")
    assert rig.failed("flaky") == 19 and rig.receiver.stats()["endpoints"]["flaky"]["requests"] == 20

    [stopped] = wait_until(lambda: rig.alerts() or None, 30, "the stopped email")
    assert stopped["subject"] == "Webhook delivery stopped" and stopped["to"] == MEMBERS
    assert ep["id"] in stopped["text"] and "tenant-a" in stopped["text"] and "HTTP 500" in stopped["text"]
    assert metric(rig.health_ports[0], "webhook_endpoint_degradations_total") == 1
    assert metric(rig.health_ports[0], "dispatch_role_running", role="endpoint-health") == 1  # DispatchRoleGone


def test_dropped_then_stopped_sends_both_emails(rig):
    """Given an endpoint answering 500 and the 9-attempt schedule shrunk 5,000 times,
    When one delivery uses up its 9 attempts (9 failures in a row) and then a new event fails (the tenth),
    Then its members get "Webhook event dropped" and then "Webhook delivery stopped": stopped is always sent,
    even after a dropped in the same 24 h."""
    api = rig.start(scale=0.0002)
    rig.register("down", status=500)
    [d] = rig.publish(1)
    assert final_delivery(api, d["delivery_id"], timeout=60)["status"] == "dropped"
    wait_until(lambda: len(rig.alerts()) == 1, 30, "the dropped email")
    rig.publish(1)
    wait_until(lambda: len(rig.alerts()) == 2, 30, "the stopped email")
    assert [m["subject"] for m in rig.alerts()] == ["Webhook event dropped", "Webhook delivery stopped"]


def test_after_stopped_a_dropped_delivery_is_silenced(rig, stack, names):
    """Given a degraded endpoint whose "stopped" email went out,
    When an attempt that was already in flight comes back failed and its delivery is dropped (the attempt
    event a worker writes then, produced here directly),
    Then no "dropped" email goes out (it is counted as suppressed), and the app's state is unchanged."""
    rig.start(scale=2.0)
    ep = rig.register("late", status=500)
    rig.publish(DEGRADE_AFTER)
    rig.wait_state(ep, "degraded")
    wait_until(lambda: len(rig.alerts()) == 1, 30, "the stopped email")
    late_dropped_attempt(stack, names, ep["id"])
    port = rig.health_ports[0]
    wait_until(lambda: metric(port, "webhook_endpoint_alerts_total", kind="dropped", result="suppressed") == 1, 30,
               "the dropped alert to be suppressed")
    assert [m["subject"] for m in rig.alerts()] == ["Webhook delivery stopped"]


def test_a_deleted_endpoints_row_and_state_are_removed_and_its_late_attempts_ignored(rig, stack, names):
    """Given a degraded endpoint (its row in the table, its state published, its "stopped" email sent),
    When its tenant deletes it, and then an attempt that was in flight comes back failed and dropped,
    Then its row is removed (a tombstone on the table's changelog) and its state too (a tombstone on
    notif.endpoint.state, which every follower reads), and the late attempt neither brings the row back nor
    sends its tenant a "dropped" email."""
    api = rig.start(scale=2.0)
    ep = rig.register("doomed", status=500)
    rig.publish(DEGRADE_AFTER)
    rig.wait_state(ep, "degraded")
    wait_until(lambda: len(rig.alerts()) == 1, 30, "the stopped email")
    port = rig.health_ports[0]

    assert api.delete(f"/v1/endpoints/{ep['id']}", headers=api.keys["a"]).status_code == 204
    wait_until(lambda: metric(port, "webhook_endpoint_health_events_total", kind="deleted") == 1, 30,
               "the deleted endpoint's row to be removed")
    changelog = f"{names.endpoint_health_app}-health-changelog"
    row_key = orjson.dumps(ep["id"])  # the table's keys are JSON strings

    def last_value(topic: str, key: bytes) -> bytes | None:
        """The key's last record (all of a key's records are in one partition, or a tombstone misses its row)."""
        records = [m for m in committed_messages(stack.bootstrap, topic) if m.key() == key]
        assert len({m.partition() for m in records}) == 1, [(m.partition(), m.value() is None) for m in records]
        return records[-1].value()

    assert last_value(names.endpoint_state, ep["id"].encode()) is None  # acknowledged before the row goes
    wait_until(lambda: last_value(changelog, row_key) is None, 30, "the row's tombstone on the changelog")

    late_dropped_attempt(stack, names, ep["id"])
    wait_until(lambda: metric(port, "webhook_endpoint_health_events_total", kind="of_deleted") == 1, 30,
               "the late attempt to be ignored")
    rig.wait_committed(stack, names)
    assert last_value(changelog, row_key) is None
    assert metric(port, "webhook_endpoint_alerts_total", kind="dropped", result="sent") is None
    assert [m["subject"] for m in rig.alerts()] == ["Webhook delivery stopped"]


def test_a_second_incident_after_reactivation_gets_its_own_email(rig):
    """Given an endpoint degraded by 10 failures ("stopped" sent),
    When the tenant reactivates it and it fails 10 times again the same day,
    Then it is active again within 5 s of the reactivation (its counter reset: it takes 10 new failures), and
    degrades again with a second "stopped" email that has its own send id."""
    api = rig.start(scale=10.0)
    ep = rig.register("twice", status=500)
    rig.publish(DEGRADE_AFTER)
    rig.wait_state(ep, "degraded")
    wait_until(lambda: len(rig.alerts()) == 1, 30, "the first stopped email")

    r = api.post(f"/v1/endpoints/{ep['id']}/reactivate", headers=api.keys["a"])
    assert r.status_code == 200, r.text
    asked = time.time()
    active = rig.wait_state(ep, "active")
    print(f"active again {active - asked:.2f} s after the reactivation")
    assert active - asked < 5.0
    before = rig.failed("twice")
    rig.publish(DEGRADE_AFTER - 1)
    rig.wait_failed("twice", before + DEGRADE_AFTER - 1)
    rig.wait_applied(2 * DEGRADE_AFTER - 1)
    assert rig.state(ep) == "active"
    rig.publish(1)
    rig.wait_state(ep, "degraded")
    wait_until(lambda: len(rig.alerts()) == 2, 30, "the second stopped email")
    first, second = rig.alerts()
    assert first["subject"] == second["subject"] == "Webhook delivery stopped"
    assert first["send_id"] != second["send_id"]
    assert api.post("/v1/endpoints/ep_missing/reactivate", headers=api.keys["a"]).status_code == 404
    assert api.post(f"/v1/endpoints/{ep['id']}/reactivate", headers=api.keys["b"]).status_code == 404


def test_the_app_killed_mid_incident_keeps_its_count_and_never_sends_an_email_twice(rig, stack, names):
    """Given 5 consecutive failures applied by the endpoint-health app,
    When the app is killed with kill -9, restarted, and the endpoint fails 5 more times; and the new copy is
    killed with kill -9 right after the "stopped" email went out, and started again,
    Then the restarted app degrades the endpoint at exactly the tenth failure (its count came back from the
    changelog), and the members get exactly one email, delivered once."""
    rig.start(scale=10.0)
    ep = rig.register("crashy", status=500)
    rig.publish(5)
    rig.wait_failed("crashy", 5)
    rig.wait_applied(5)
    rig.wait_committed(stack, names)  # the next copy cannot read them again: their count comes from the changelog
    rig.kill("endpoint-health")
    rig.start_health("endpoint-health-2")
    rig.publish(4)
    rig.wait_failed("crashy", 9)
    rig.wait_applied(4, rig.health_ports[1])
    assert rig.state(ep) == "active"
    rig.publish(1)
    rig.wait_state(ep, "degraded")
    wait_until(lambda: rig.alerts() or None, 30, "the stopped email")
    rig.kill("endpoint-health-2")

    rig.start_health("endpoint-health-3")
    wait_until(lambda: committed_lag(stack.bootstrap, names.endpoint_health_app, names.webhook_attempts) == 0, 60,
               "the third copy to have read every attempt")
    email = names.lane("email", "transactional")
    wait_until(lambda: committed_lag(stack.bootstrap, names.group("email", "transactional"), email) == 0, 30,
               "every alert email to be handled")
    assert rig.failed("crashy") == 10 and rig.state(ep) == "degraded"
    assert [m["subject"] for m in rig.alerts()] == ["Webhook delivery stopped"]
    assert rig.provider.stats()["duplicate_deliveries"] == 0


def test_state_moves_with_its_endpoints_when_copies_join_and_die(rig, stack, names):
    """Given one endpoint-health copy that applied 5 consecutive failures,
    When a second copy joins (a rebalance), the first is then killed with kill -9 (the second takes every
    partition after the session timeout), and the endpoint fails 5 more times,
    Then the endpoint degrades at exactly the tenth failure and one "stopped" email goes out."""
    rig.start(scale=10.0)
    ep = rig.register("moving", status=500)
    rig.publish(5)
    rig.wait_failed("moving", 5)
    rig.wait_applied(5)
    rig.wait_committed(stack, names)  # the second copy cannot read them again: their count moves with the table
    rig.start_health("endpoint-health-2")
    rig.kill("endpoint-health")
    rig.publish(4)
    rig.wait_failed("moving", 9)
    try:
        rig.wait_applied(4, rig.health_ports[1])
    except AssertionError as exc:  # did the attempts reach the topic, and did the group read past them?
        positions = LagReader(stack.bootstrap).positions(names.endpoint_health_app, names.webhook_attempts)
        raise AssertionError(f"{exc}; attempts partition -> (committed, end): {positions}") from None
    assert rig.state(ep) == "active"
    rig.publish(1)
    rig.wait_state(ep, "degraded", timeout=60)
    wait_until(lambda: rig.alerts() or None, 30, "the stopped email")
    assert rig.failed("moving") == 10 and len(rig.alerts()) == 1


def test_an_extreme_backlog_is_shed_separately_from_degradation(rig):
    """Given backlog limits of 3 undelivered deliveries (any age) and an endpoint answering 500 (3 failures:
    far from degraded), next to a healthy endpoint of the same tenant,
    When a fourth event is published,
    Then its delivery to the backlogged endpoint is recorded as skipped (backlog_shed) while the healthy
    endpoint gets it; the skipped delivery is listed and can be replayed once the receiver is fixed."""
    api = rig.start(scale=10.0, health=False,
                    api_env={"WEBHOOK_BACKLOG_MAX_COUNT": "3", "WEBHOOK_BACKLOG_MAX_AGE_S": "0"})
    slow = rig.register("behind", status=500)
    rig.publish(3)
    rig.wait_failed("behind", 3)
    healthy = rig.register("fine")
    fourth = rig.publish(1)
    by_endpoint = {d["endpoint_id"]: d for d in fourth}
    assert by_endpoint[slow["id"]]["skipped"] == "backlog_shed"
    assert by_endpoint[healthy["id"]].get("skipped") is None
    assert final_delivery(api, by_endpoint[healthy["id"]]["delivery_id"])["status"] == "delivered"
    shed = final_delivery(api, by_endpoint[slow["id"]]["delivery_id"])
    assert (shed["status"], shed["reason"]) == ("skipped", "backlog_shed") and rig.failed("behind") == 3
    assert skipped_at_ingest(api, "backlog_shed") == 1

    rig.receiver.configure("behind", status=200)
    r = api.post(f"/v1/deliveries/{by_endpoint[slow['id']]['delivery_id']}/replay", headers=api.keys["a"])
    assert r.status_code == 202, r.text
    assert final_delivery(api, r.json()["delivery_id"])["status"] == "delivered"


def test_members_are_validated_and_private_to_their_tenant(rig):
    """Given tenant a's members,
    When a tenant sets an address that is not one, or more than 50, and tenant b reads its own,
    Then each bad list is refused (422) naming the field without echoing the address, a's list is unchanged,
    and b sees only its own (empty) list."""
    api = rig.start(scale=1.0, health=False)
    bad = api.put("/v1/members", json={"emails": ["ok@tenant-a.test", "not-an-address"]}, headers=api.keys["a"])
    assert bad.status_code == 422 and "emails[1]" in bad.text and "not-an-address" not in bad.text
    many = api.put("/v1/members", json={"emails": [f"m{i}@tenant-a.test" for i in range(51)]},
                   headers=api.keys["a"])
    assert many.status_code == 422 and "at most 50" in many.text
    assert api.get("/v1/members", headers=api.keys["a"]).json()["emails"] == MEMBERS
    assert api.get("/v1/members", headers=api.keys["b"]).json()["emails"] == []


def test_attempt_events_it_cannot_read_are_counted_as_malformed_and_the_rest_applied(rig, stack, names):
    """Given attempt events written by someone else: a key that is not UTF-8, a time that is a string, a
    dropped delivery whose tenant is a list, and then a good event,
    When the endpoint-health app reads them,
    Then the three are counted as malformed (not a crash of its agent), the good one is applied, the app
    commits to the end, and it keeps running."""
    from confluent_kafka import Producer

    health = rig.start_health()
    port = rig.health_ports[0]
    now = int(time.time() * 1000)
    event = {"kind": "attempt", "delivery_id": "d-1", "tenant_id": "tenant-a", "endpoint_id": "ep_poison", "n": 1,
             "at_ms": now, "status_code": 500, "outcome": "unavailable", "error": "http_500"}
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    for key, value in ((b"\xff\xfe", event), (b"ep_poison", {**event, "at_ms": "x"}),
                       (b"ep_poison", {**event, "tenant_id": ["tenant-a"], "dropped": True}),
                       (b"ep_poison", event)):
        producer.produce(names.webhook_attempts, key=key, value=orjson.dumps(value))
    assert producer.flush(10) == 0
    wait_until(lambda: metric(port, "webhook_endpoint_health_events_total", kind="malformed") == 3, 60,
               "the three unreadable events to be counted")
    rig.wait_applied(1, port)
    rig.wait_committed(stack, names)
    assert health.poll() is None


class _Assigned:
    """The parts of faust's consumer the app's re-reading uses: the assignment, and the seeks it asks for
    (faust's own consumer loses fetched records only in a race a test cannot time)."""

    def __init__(self, tps):
        self.tps, self.seeks = set(tps), []

    def assignment(self):
        return set(self.tps)

    async def seek_wait(self, offsets):
        self.seeks.extend((tp.partition, offset) for tp, offset in offsets.items())


@pytest.fixture
def attempts_at(stack, names, channel_topics):
    """Attempt events on the real attempts topic and the endpoint-health group's committed offsets:
    {partition: (records, committed)}."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    channel_topics("webhook")

    def _write(layout: dict[int, tuple[int, int]]) -> None:
        producer = Producer({"bootstrap.servers": stack.bootstrap})
        for partition, (records, _) in layout.items():
            for _ in range(records):
                producer.produce(names.webhook_attempts, key=b"ep", value=b"{}", partition=partition)
        assert producer.flush(10) == 0
        group = Consumer({"bootstrap.servers": stack.bootstrap, "group.id": names.endpoint_health_app,
                          "enable.auto.commit": False})
        group.commit(offsets=[TopicPartition(names.webhook_attempts, p, committed)
                              for p, (_, committed) in layout.items()], asynchronous=False)
        group.close()

    return _write


def _health_app(dispatch_env, assigned):
    from types import SimpleNamespace

    from streams.config import Config
    from streams.health.app import EndpointHealthApp

    health = EndpointHealthApp(Config.from_env(dispatch_env), directory=SimpleNamespace(close=lambda: None))
    health.app.consumer = assigned
    return health


def _rereads() -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("webhook_endpoint_health_rereads_total", {"topic": "attempts"}) or 0.0


def test_a_partition_whose_records_never_reached_the_agent_is_read_again_from_its_committed_offset(
        names, attempts_at, dispatch_env):
    """Given attempt events past the group's committed offset on partitions 0 and 2, and partition 1 caught up,
    with partitions 0 and 1 assigned to this copy (as faust leaves a partition whose fetched records it lost),
    When the app checks its partitions against the broker, with its agent idle,
    Then after two checks in a row (and not at the first) it reads partition 0 again from its committed offset,
    once; never the partition another copy holds, nor one the agent took an event from in between."""
    import asyncio

    from faust.types import TP

    topic = names.webhook_attempts
    attempts_at({0: (3, 1), 1: (2, 2), 2: (4, 1)})

    async def checks(take_between: bool) -> tuple[list, list]:
        assigned = _Assigned({TP(topic, 0), TP(topic, 1)})
        health = _health_app(dispatch_env, assigned)
        try:
            await health._reread_stalled()
            first = list(assigned.seeks)
            if take_between:
                health.taken[0] = 1  # the agent took an event from partition 0: its commit will follow
            # Two checks in a row that read the broker's offsets; one the broker did not answer in time (a
            # loaded machine) starts the count again, so a few more are allowed before the seek must have come.
            for _ in range(8):
                await health._reread_stalled()
                if assigned.seeks:
                    break
            await health._reread_stalled()  # still at offset 1 (when read again): not again from it
            return first, assigned.seeks
        finally:
            health.close()

    before = _rereads()
    assert asyncio.run(checks(take_between=False)) == ([], [(0, 1)])
    assert _rereads() == before + 1
    first, seeks = asyncio.run(checks(take_between=True))
    assert first == [] and seeks == [(0, 1)]  # only after two more checks without an event from it


def test_a_check_before_the_consumer_can_say_its_assignment_passes_without_ending_the_app(dispatch_env):
    """Given faust's consumer not started yet (it raises when asked for its assignment),
    When the stall check runs (a faust timer: an exception there would end the whole app),
    Then it passes without an exception and without reading anything again."""
    import asyncio

    class NotStarted(_Assigned):
        def assignment(self):
            raise RuntimeError("consumer not started")

    assigned = NotStarted(set())
    health = _health_app(dispatch_env, assigned)
    try:
        asyncio.run(health._reread_stalled())
    finally:
        health.close()
    assert assigned.seeks == []


class _Recovering(_Assigned):
    """Also the consumer's positions: each changelog partition fetched to its end."""

    def __init__(self, tps, positions):
        super().__init__(tps)
        self.positions = positions

    async def position(self, tp):
        return self.positions[tp]


def test_a_recovery_waiting_for_records_already_fetched_reads_them_again(dispatch_env):
    """Given this copy recovering changelog partitions 3 and 4 (taken over from a copy that died),
    each fetched to its end (position past its last offset), partition 3 with nothing applied, 4 applying,
    When the app checks its recovery every few seconds,
    Then at the second check in a row without progress it reads partition 3 again from its start, once
    for those two checks; never partition 4, whose recovery went on between the checks."""
    import asyncio

    from faust.types import TP
    from prometheus_client import REGISTRY

    def rereads() -> float:
        return REGISTRY.get_sample_value("webhook_endpoint_health_rereads_total", {"topic": "changelog"}) or 0.0

    async def checks() -> list:
        health = _health_app(dispatch_env, None)
        changelog = health.table.changelog_topic.get_topic_name()
        tp3, tp4 = TP(changelog, 3), TP(changelog, 4)
        health.app.consumer = _Recovering({tp3, tp4}, {tp3: 5, tp4: 8})
        recovery = health.app.tables.recovery
        recovery.in_recovery = True
        recovery.active_tps.update({tp3, tp4})
        recovery.active_highwaters.update({tp3: 4, tp4: 7})
        recovery.active_offsets.update({tp3: None, tp4: 2})
        try:
            await health._unstick_recovery()
            recovery.active_offsets[tp4] = 5  # partition 4 applied more in between
            await health._unstick_recovery()
            recovery.active_offsets[tp4] = 6
            await health._unstick_recovery()  # the first check after reading 3 again
            return health.app.consumer.seeks
        finally:
            health.close()

    before = rereads()
    assert asyncio.run(checks()) == [(3, 0)]
    assert rereads() == before + 1


def test_the_changelog_topic_exists_and_is_visible_before_the_app_starts(stack, names, channel_topics, dispatch_env):
    """Given no changelog topic yet (a fresh deployment),
    When two copies of the app prepare to start at the same moment, and later one again,
    Then the table's changelog topic exists, compacted, with the attempts topic's partitions, and the brokers'
    metadata shows it before faust subscribes (a consumer that subscribed earlier would not see it for
    minutes, and the first row written would crash the agent); the third time changes nothing. A changelog
    with another partition count stops the copy with the reason, instead of a crash at the first row."""
    from concurrent.futures import ThreadPoolExecutor
    from dataclasses import replace

    from streams.errors import TopicPlanError
    from streams.topology.admin import TopicAdmin

    channel_topics("webhook")
    changelog = f"{names.endpoint_health_app}-health-changelog"
    admin = TopicAdmin(stack.bootstrap)
    assert admin.state([changelog]) == {}
    copies = [_health_app(dispatch_env, None) for _ in range(3)]
    try:
        with ThreadPoolExecutor(2) as pool:  # two copies starting at the same moment: both succeed
            list(pool.map(lambda copy: copy.ensure_changelog(), copies[:2]))
        state = admin.state([changelog])[changelog]
        assert state.partitions == admin.state([names.webhook_attempts])[names.webhook_attempts].partitions == 6
        assert state.overrides.get("cleanup.policy") == "compact"
        copies[2].ensure_changelog()
        assert admin.state([changelog])[changelog] == state
        copies[2].attempts_spec = replace(copies[2].attempts_spec, partitions=3)  # e.g. a redefined topic
        with pytest.raises(TopicPlanError, match="has 6 partitions where 3 are needed"):
            copies[2].ensure_changelog()
    finally:
        for copy in copies:
            copy.close()
        admin.delete(admin.named(f"{names.endpoint_health_app}-"))


def test_another_tenants_events_naming_an_endpoint_never_take_its_health_or_its_alerts(rig, stack, names):
    """Given tenant a's endpoint, whose first attempt event is one of tenant b's naming it (written to a lane past
    ingest and sent by a worker of an older version, so not refused as `endpoint_of_another_tenant`),
    When a's own receiver then fails ten times in a row,
    Then the endpoint is degraded and the "stopped" alert goes to a's members: the health is a's, from the endpoint
    itself (before: the first event made it b's, and a's failures were then ignored as another tenant's)."""
    from confluent_kafka import Producer

    rig.start(scale=0.001)
    ep = rig.register("forged-first")
    now = int(time.time() * 1000)
    failure = {"kind": "attempt", "endpoint_id": ep["id"], "n": 1, "at_ms": now, "status_code": 500,
               "outcome": "unavailable", "error": "http_500"}
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    key = ep["id"].encode()
    producer.produce(names.webhook_attempts, key=key,
                     value=orjson.dumps({**failure, "tenant_id": "tenant-b", "delivery_id": "d-forged"}))
    for i in range(DEGRADE_AFTER):
        producer.produce(names.webhook_attempts, key=key,
                         value=orjson.dumps({**failure, "tenant_id": "tenant-a", "delivery_id": f"d-{i}",
                                             "at_ms": now + i}))
    assert producer.flush(10) == 0
    rig.wait_state(ep, "degraded", timeout=60)
    wait_until(lambda: any(m["subject"] == "Webhook delivery stopped" for m in rig.alerts()), 60,
               "the stopped alert")
    [alert] = [m for m in rig.alerts() if m["subject"] == "Webhook delivery stopped"]
    assert alert["to"] == MEMBERS


def test_an_egress_outage_of_ours_degrades_no_endpoint_and_mails_no_one(rig):
    """Given an endpoint of each of three tenants whose receivers refuse every connection (as when our egress
    proxy is down), with members on tenant a's project,
    When one event of each tenant reaches its endpoint, and then ten more of each (more than the 10 consecutive
    failures that degrade an endpoint),
    Then every attempt fails and endpoint health applies them all, yet the three stay active and nobody is
    mailed: of the first three refusals, two count as their receivers' and the third shows that no receiver
    can be reached, after which the worker takes the refusals for its own (`egress_unavailable`), which
    health leaves uncounted. Before, each endpoint counted all eleven and was degraded, its members mailed."""
    rig.start(scale=4.0, tenants={"a": "tenant-a", "b": "tenant-b", "c": "tenant-c"})  # no retry due meanwhile
    eps = []
    for who in "abc":
        r = rig.api.post("/v1/endpoints", json={"url": f"http://127.0.0.1:{free_port()}/hooks/refusing",
                                                "event_types": ["invoice.paid"]}, headers=rig.api.keys[who])
        assert r.status_code == 201, r.text
        eps.append((who, r.json()))

    assert [len(rig.publish(1, who)) for who, _ in eps] == [1] * 3
    rig.wait_applied(3)
    assert [len(rig.publish(10, who)) for who, _ in eps] == [10] * 3
    rig.wait_applied(33)
    port = rig.health_ports[0]
    assert metric(port, "webhook_endpoint_consecutive_failures_count") == 2  # the first two, one failure each
    assert (metric(port, "webhook_endpoint_degradations_total") or 0) == 0
    assert [rig.state(ep, who) for who, ep in eps] == ["active"] * 3
    assert rig.alerts() == []
