"""Helpers the tests share (plain functions and classes; fixtures live in the conftest files)."""

from __future__ import annotations

import subprocess
import time
import uuid
from types import SimpleNamespace

import httpx
import redis
from confluent_kafka import Consumer, ConsumerGroupState, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient
from prometheus_client.parser import text_string_to_metric_families

from streams.devtools.fleet import free_port, local_client
from streams.state.log import OperatorLog

__all__ = ["free_port", "local_client", "wait_until", "MockProvider", "email_request", "sms_request", "committed_lag",
           "read_topic", "metric"]


# What a look at a process or the broker may meet for a moment on a loaded machine (a /metrics request timing out,
# the group coordinator moving): the condition is asked again, not the wait ended.
TRANSIENT = (httpx.TransportError, KafkaException, ConnectionError, TimeoutError, redis.ConnectionError,
             redis.TimeoutError)


def wait_until(predicate, timeout: float, what: str, interval: float = 0.1):
    """Poll an observable condition until it holds (bounded); fail naming what was awaited (and the last
    transient error met while asking, if the last ask met one)."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except TRANSIENT as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


class AcknowledgingProducer:
    """A broker that takes every record and acknowledges it at the next poll, once `acknowledging` (unit tests
    of what waits for acknowledgements)."""

    def __init__(self, acknowledging: bool = True):
        self.reports: list = []
        self.acknowledging = acknowledging

    def produce(self, topic, value=None, key=None, headers=None, on_delivery=None):
        self.reports.append(on_delivery)

    def poll(self, timeout=0):
        if not self.acknowledging:
            return 0
        reports, self.reports = self.reports, []
        for report in reports:
            report(None, SimpleNamespace(partition=lambda: 0, offset=lambda: 0))
        return len(reports)

    def flush(self, timeout=0):
        self.poll()
        return len(self.reports)


class PauseRecordingConsumer:
    """A consumer that only records which partitions are paused (unit tests of pause decisions). With
    `assigned_only`, a pause of a partition not assigned yet is skipped, as librdkafka skips it (inside on_assign,
    before the callback assigns them, a new consumer's partitions are not)."""

    def __init__(self, assigned_only: bool = False):
        self.paused: set[tuple[str, int]] = set()
        self.assigned: set[tuple[str, int]] = set()
        self.assigned_only = assigned_only

    def incremental_assign(self, partitions):
        self.assigned |= {(p.topic, p.partition) for p in partitions}

    def pause(self, partitions):
        self.paused |= {(p.topic, p.partition) for p in partitions
                        if not self.assigned_only or (p.topic, p.partition) in self.assigned}

    def resume(self, partitions):
        self.paused -= {(p.topic, p.partition) for p in partitions}


class MockProvider:
    """The mock provider process, driven over its HTTP control endpoints."""

    def __init__(self, port: int, proc: subprocess.Popen):
        self.url = f"http://127.0.0.1:{port}"
        self.proc = proc
        self.http = local_client(base_url=self.url, timeout=10)

    def stats(self, deliveries: bool = False) -> dict:
        return self.http.get("/_mock/stats", params={"deliveries": "1"} if deliveries else None).json()

    def emails(self) -> list[dict]:
        """The emails the mock delivered (the last 1,000), oldest first."""
        return self.http.get("/_mock/stats", params={"messages": "1"}).json()["messages"]

    def configure(self, **settings) -> None:
        self.http.post("/_mock/config", json=settings).raise_for_status()

    def reset(self, **settings) -> None:
        defaults = {"rate": 1000.0, "latency_ms": 0.0, "fault_5xx_ratio": 0.0, "fault_408_ratio": 0.0,
                    "fault_timeout_ratio": 0.0,
                    "fault_401_ratio": 0.0, "timeout_delay_s": 15.0, "hold_answers": False, "hold_answers_after": 0,
                    "fault_502_after_accept_ratio": 0.0, "token_ttl_s": 30.0, "sms_no_id_ratio": 0.0,
                    "sms_unsupported_prefixes": "", "sms_invalid_prefixes": "", "revoked_api_keys": ""}
        self.configure(**{**defaults, **settings})
        self.http.post("/_mock/reset").raise_for_status()

    def answering(self) -> bool:
        try:
            return self.http.get("/_mock/stats").status_code == 200
        except httpx.TransportError:
            return False


def email_request(category: str = "transactional", **payload) -> dict:
    return {"channel": "email", "category": category, "template_id": "welcome", "template_version": "7",
            "payload": {"from": "Acme <no-reply@acme.test>", "to": ["user@example.test"],
                        "subject": "Hello", "html": "<p>Hi</p>", **payload}}


def sms_request(category: str = "transactional") -> dict:
    return {"channel": "sms", "category": category, "template_id": "otp", "template_version": "1",
            "payload": {"to": "+14155550123", "body": "Your code is 123456"}}


def group_assigned(bootstrap: str, group: str) -> bool:
    """Whether `group` has joined and its members hold their partitions (a role says it consumes before it has
    joined: on a loaded machine, seconds before)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})  # kept: its futures need it alive
    [described] = admin.describe_consumer_groups([group]).values()
    found = described.result(10)
    return found.state == ConsumerGroupState.STABLE and any(m.assignment.topic_partitions for m in found.members)


def committed_lag(bootstrap: str, group: str, topic: str) -> int:
    """Messages of `topic` not yet committed by `group` (end offset - committed, summed).
    Transient coordinator errors (a group being created or rebalanced) are retried a few times."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        for attempt in range(5):
            try:
                md = c.list_topics(topic, timeout=10)
                parts = [TopicPartition(topic, p) for p in md.topics[topic].partitions]
                committed = c.committed(parts, timeout=10)
                lag = 0
                for tp in committed:
                    _, high = c.get_watermark_offsets(TopicPartition(topic, tp.partition), timeout=10)
                    lag += high - (tp.offset if tp.offset >= 0 else 0)
                return lag
            except KafkaException:
                if attempt == 4:
                    raise
                time.sleep(0.5)  # a coordinator still loading: ask again shortly
        raise AssertionError("unreachable")
    finally:
        c.close()


def count_records(bootstrap: str, topic: str, timeout: float = 30.0) -> int:
    """The committed records of `topic` now (a transaction's commit marker takes an offset but is not
    a record, and an aborted transaction's records are never read)."""
    return len(committed_messages(bootstrap, topic, timeout))


def read_topic(bootstrap: str, topic: str, expect: int, timeout: float = 30.0) -> list:
    """Read `expect` messages from the start of `topic` (fails after `timeout`)."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{uuid.uuid4().hex}",
                  "auto.offset.reset": "earliest", "enable.auto.commit": False})
    c.subscribe([topic])
    out: list = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < expect and time.monotonic() < deadline:
            for m in c.consume(num_messages=1000, timeout=0.5):
                if not m.error():
                    out.append(m)
    finally:
        c.close()
    assert len(out) >= expect, f"read {len(out)} of {expect} expected messages from {topic}"
    return out


def metric(port: int, name: str, **labels) -> float | None:
    """One sample from a process's /metrics (None when absent)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


_HANDED_OUT: set[int] = set()


def free_port_pair() -> int:
    """A port whose successor is free too (Kafka's controller listens on port + 1), never handed out before in this
    run. From below the range the kernel gives outgoing connections (one of those could take it between this
    check and the stack's bind, seconds later) and apart from the cluster suite's ports and the dev stack's."""
    import random
    import socket

    def bindable(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return True
            except OSError:
                return False

    for _ in range(200):
        port = random.randrange(12_000, 15_998)
        if {port, port + 1} & _HANDED_OUT or not (bindable(port) and bindable(port + 1)):
            continue
        _HANDED_OUT.update((port, port + 1))
        return port
    raise RuntimeError("no free port pair between 12000 and 15999")


def private_stack(home):
    """A LocalStack of its own (home, ports, data), reusing the session's Kafka jar cache."""
    from streams.config import StackConfig
    from streams.devtools.stack import LocalStack

    shared = StackConfig.from_env().home / "kafka"
    (home / "kafka").symlink_to(shared, target_is_directory=True)
    return LocalStack(StackConfig(home=home, kafka_bootstrap=None, redis_url=None,
                                  kafka_port=free_port_pair(), redis_port=free_port_pair()))


def answers(client: httpx.Client, path: str = "/openapi.json") -> bool:
    """Whether an HTTP server of ours answers 200 on `path` yet."""
    try:
        return client.get(path).status_code == 200
    except httpx.TransportError:
        return False


class MockEndpoint:
    """The mock webhook receiver process (`streams mock-endpoint`), driven over its control endpoints."""

    def __init__(self, port: int, proc: subprocess.Popen):
        self.base = f"http://127.0.0.1:{port}"
        self.proc = proc
        self.http = local_client(base_url=self.base, timeout=10)

    def url(self, name: str) -> str:
        return f"{self.base}/hooks/{name}"

    def configure(self, name: str, **behaviour) -> None:
        self.http.post(f"/_mock/endpoints/{name}", json=behaviour).raise_for_status()

    def defaults(self, **behaviour) -> None:
        self.http.post("/_mock/defaults", json=behaviour).raise_for_status()

    def stats(self, deliveries: bool = False) -> dict:
        return self.http.get("/_mock/stats", params={"deliveries": "1"} if deliveries else None).json()

    def reset(self) -> None:
        self.http.post("/_mock/reset").raise_for_status()


def start_api(fleet, port: int, tenants: dict[str, str], redis_client, namespace: str,
              env: dict | None = None) -> httpx.Client:
    """Start the ingest API in `fleet` (with `env` added to its environment); returns a client with
    `.keys[name]` headers for each tenant (and "operator")."""
    from streams.ingest.api_keys import ApiKeys

    fleet.start("api", "api", "--port", str(port), env=env)
    client = local_client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    wait_until(lambda: answers(client), 30, "the ingest API to answer")
    keys = ApiKeys(redis_client, namespace)
    client.keys = {name: {"Authorization": f"Bearer {keys.create('tenant', tenant)}"}  # type: ignore[attr-defined]
                   for name, tenant in tenants.items()}
    client.keys["operator"] = {"Authorization": f"Bearer {keys.create('operator')}"}  # type: ignore[attr-defined]
    return client


# ---------------------------------------------------------------- webhooks through the ingest API
def webhook_event(event_type: str = "invoice.paid", **data) -> dict:
    return {"channel": "webhook", "category": "transactional",
            "payload": {"event_type": event_type, "occurredAt": "2026-11-30T12:00:00Z", "data": {"id": 7, **data}}}


def register_endpoint(api, mock_endpoint, name: str, who: str = "a", event_types=("invoice.paid",),
                      **behaviour) -> dict:
    """Register the mock receiver's endpoint `name` for tenant `who`, the receiver knowing its secret."""
    r = api.post("/v1/endpoints", json={"url": mock_endpoint.url(name), "event_types": list(event_types),
                                        "description": name}, headers=api.keys[who])
    assert r.status_code == 201, r.text
    ep = r.json()
    assert ep["secret"].startswith("whsec_")
    mock_endpoint.configure(name, secrets=[ep["secret"]], **behaviour)
    return ep


def delivery(api, delivery_id: str, who: str = "a") -> dict:
    return api.get(f"/v1/deliveries/{delivery_id}", headers=api.keys[who]).json()


def final_delivery(api, delivery_id: str, timeout: float = 30, who: str = "a") -> dict:
    return wait_until(lambda: (d := delivery(api, delivery_id, who)).get("status") in ("delivered", "dropped", "skipped")
                      and d, timeout, f"delivery {delivery_id} to finish", interval=0.3)


def report_outcome(scenario: str, ids: list[str], stats: dict, procs) -> str:
    """One line for a fault scenario's record: sends published, delivered (by the provider), lost and
    duplicated, and the processes alive at the end. `stats` is the mock provider's, with deliveries."""
    delivered = set(stats["deliveries"])
    published = set(ids)
    alive = [name for name, proc, _ in procs if proc.poll() is None]
    line = (f"{scenario}: published {len(published)}, delivered {len(published & delivered)}, "
            f"lost {len(published - delivered)}, duplicates {stats['duplicate_deliveries']}, "
            f"processes alive {len(alive)}/{len(list(procs))} ({', '.join(alive)})")
    print(line)
    return line


def metric_sum(text: str, name: str) -> float:
    """The sum of a metric's samples in a Prometheus text exposition (0 when absent)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def read_committed(bootstrap: str, topic: str) -> list[dict]:
    """Every record of `topic` a read-committed consumer reads, JSON-decoded, from its start to its end as
    it is now."""
    import orjson

    return [orjson.loads(m.value()) for m in committed_messages(bootstrap, topic)]


def committed_messages(bootstrap: str, topic: str, timeout: float = 60.0) -> list:
    """Every message of `topic` a read-committed consumer reads, from its start to its end as it is now.
    Watermarks are asked again while no leader answers (a broker just back from a stall)."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"committed-reader-{uuid.uuid4().hex}",
                  "enable.auto.commit": False, "isolation.level": "read_committed"})
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions

        def watermarks() -> dict[int, tuple[int, int]] | None:
            try:
                return {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10) for p in parts}
            except KafkaException:
                return None

        ends = wait_until(watermarks, 60, f"{topic}'s partitions to have a leader", interval=0.5)
        c.assign([TopicPartition(topic, p, low) for p, (low, _) in ends.items()])
        messages: list = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            messages.extend(m for m in c.consume(num_messages=1000, timeout=0.2) if not m.error())
            positions = c.position([TopicPartition(topic, p) for p in parts])
            if all(tp.offset >= ends[tp.partition][1] or ends[tp.partition][0] == ends[tp.partition][1]
                   for tp in positions):
                return messages
        raise AssertionError(f"reading {topic} did not finish within {timeout:.0f} s")
    finally:
        c.close()


def retry_policies(policies: tuple[str, ...], max_attempts: int, max_age: str, schedule: str = "10s") -> str:
    """DUAL_RAIL_RETRY_POLICIES for tests that walk a whole schedule: each named policy with the same values."""
    sections = "".join(f'[policy.{name}]\nmax_attempts = {max_attempts}\nmax_age = "{max_age}"\n'
                       f'schedule = ["{schedule}"]\n\n' for name in policies)
    return sections + ('[routing]\ncategories = { transactional = "transactional", product = "transactional", '
                       'marketing = "marketing" }\n')


# 3 attempts, 10 s apart, within an hour.
THREE_ATTEMPTS_10S_POLICIES = retry_policies(("transactional", "marketing"), 3, "1h")


class HookedLog(OperatorLog):
    """The real operator log, running `hook(key, value)` once, after its first acknowledged put (another
    operator's change made between a change's log record and its Redis write)."""

    def __init__(self, bootstrap, topic, hook):
        super().__init__(bootstrap, topic)
        self.hook = hook

    def put(self, key, value) -> None:
        super().put(key, value)
        hook, self.hook = self.hook, None
        if hook is not None:
            hook(key, value)
