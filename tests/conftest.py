"""Session fixtures: a real Kafka and a real Redis.

Order of preference: KAFKA_BOOTSTRAP_SERVERS / REDIS_URL from the environment, else
testcontainers when a Docker engine answers, else the project's local stack (`streams dev up`).
Each test gets its own topic namespace so tests cannot interfere with each other.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass

import pytest

from streams.lanes import TopicNames


@dataclass(frozen=True)
class Stack:
    bootstrap: str
    redis_url: str


def _docker_engine_available() -> bool:
    if not shutil.which("docker"):
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def stack():
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    redis_url = os.environ.get("REDIS_URL")
    if bootstrap and redis_url:
        yield Stack(bootstrap, redis_url)
    elif _docker_engine_available():
        from testcontainers.kafka import KafkaContainer
        from testcontainers.redis import RedisContainer

        with KafkaContainer().with_kraft() as kafka, RedisContainer() as redis_c:
            host, port = redis_c.get_container_host_ip(), redis_c.get_exposed_port(6379)
            yield Stack(kafka.get_bootstrap_server(), f"redis://{host}:{port}/0")
    else:
        from streams.devstack import LocalStack

        env = LocalStack().up()
        yield Stack(env["KAFKA_BOOTSTRAP_SERVERS"], env["REDIS_URL"])


@pytest.fixture
def namespace() -> str:
    """A unique topic/group prefix for one test."""
    return f"t{uuid.uuid4().hex[:10]}."


@pytest.fixture
def names(namespace) -> TopicNames:
    return TopicNames(namespace)


@pytest.fixture
def create_topics(stack):
    """Create topics for one test (deleted afterwards): {name: partitions} with one config, or
    TopicSpec objects as they are."""
    from streams.topic_admin import TopicAdmin
    from streams.topic_spec import TopicSpec, plan

    admin = TopicAdmin(stack.bootstrap)
    created: list[str] = []

    def _create(topics: dict[str, int] | list[TopicSpec], config: dict[str, str] | None = None) -> None:
        if isinstance(topics, dict):
            topics = [TopicSpec(n, p, 1, dict(config or {})) for n, p in topics.items()]
        specs = {t.name: t for t in topics}
        admin.apply(plan(specs, admin.state(list(specs))), specs)
        created.extend(specs)

    yield _create
    try:
        admin.delete(created)
    except Exception:  # noqa: BLE001 - best effort clean-up
        pass


# ---------------------------------------------------------------- dispatch harness
import sys
import time
from pathlib import Path

import httpx

from streams.fleet import Fleet, free_port  # noqa: F401 - free_port is used by the tests

REPO = Path(__file__).resolve().parents[1]


def wait_until(predicate, timeout: float, what: str, interval: float = 0.1):
    """Poll an observable condition until it holds (bounded); fail naming what was awaited."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


class MockProvider:
    def __init__(self, port: int, proc: subprocess.Popen):
        self.url = f"http://127.0.0.1:{port}"
        self.proc = proc
        self.http = httpx.Client(base_url=self.url, timeout=10)

    def stats(self, deliveries: bool = False) -> dict:
        return self.http.get("/_mock/stats", params={"deliveries": "1"} if deliveries else None).json()

    def configure(self, **settings) -> None:
        self.http.post("/_mock/config", json=settings).raise_for_status()

    def reset(self, **settings) -> None:
        defaults = {"rate": 1000.0, "latency_ms": 0.0, "fault_5xx_ratio": 0.0, "fault_timeout_ratio": 0.0,
                    "fault_401_ratio": 0.0, "timeout_delay_s": 15.0}
        self.configure(**{**defaults, **settings})
        self.http.post("/_mock/reset").raise_for_status()


@pytest.fixture(scope="session")
def _mock_process(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("mock-provider") / "mock-provider.log"
    with open(log, "wb") as out:  # a file, not an unread pipe that could fill and block the server
        proc = subprocess.Popen([sys.executable, "-m", "streams.cli", "mock-provider", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT)
    mock = MockProvider(port, proc)

    def up():
        try:
            return mock.http.get("/_mock/stats").status_code == 200
        except httpx.TransportError:
            return False

    wait_until(up, 20, "the mock provider to answer")
    yield mock
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def mock_provider(_mock_process):
    """The mock provider, reset for this test. After the test: no request reached a forbidden path."""
    _mock_process.reset()
    yield _mock_process
    stats = _mock_process.stats()
    assert stats["forbidden"] == 0, f"requests reached forbidden provider paths: {stats['forbidden_paths']}"


@pytest.fixture
def redis_client(stack):
    import redis

    return redis.Redis.from_url(stack.redis_url)


@pytest.fixture
def dispatch_env(stack, namespace, mock_provider) -> dict:
    """Environment for the project's processes in this test (own namespace, the mock provider)."""
    return {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": stack.bootstrap, "REDIS_URL": stack.redis_url,
            "DUAL_RAIL_TOPIC_NAMESPACE": namespace, "RESEND_BASE_URL": mock_provider.url,
            "SMS_BASE_URL": mock_provider.url, "RESEND_API_KEYS": '{"*": "re_test_default"}',
            "SMS_API_KEYS": '{"*": "re_test_sms"}', "PROVIDER_TIMEOUT_S": "2", "LOG_LEVEL": "WARNING"}


@pytest.fixture
def channel_topics(namespace, create_topics):
    """Create one channel's lane and retry topics plus notif.dlq, notif.outcomes and notif.lag, as
    defined in topics/ (configs included), in this test's namespace; deleted afterwards."""
    from dataclasses import replace

    from streams.topic_spec import load_definitions

    def _create(channel: str, lane_partitions: int | None = None) -> None:
        specs = []
        for name, spec in load_definitions(REPO / "topics", namespace).items():
            bare = name[len(namespace):]
            if bare.startswith(f"notif.{channel}."):
                specs.append(replace(spec, partitions=lane_partitions or spec.partitions))
            elif bare in ("notif.dlq", "notif.outcomes", "notif.lag"):
                specs.append(spec)
        create_topics(specs)

    return _create


@pytest.fixture
def limits(redis_client, namespace):
    from streams.gate import LimitStore

    return LimitStore(redis_client, namespace)


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    procs = getattr(item, "funcargs", {}).get("processes")
    if report.when == "call" and report.failed and procs is not None:
        report.sections.append(("project process logs", procs.logs()))


@pytest.fixture
def processes(dispatch_env, namespace, tmp_path):
    """The project's processes for one test (streams.fleet.Fleet): log files shown on failure,
    SIGTERM then SIGKILL when the test ends."""
    fleet = Fleet(namespace, tmp_path / "logs", base_env=dispatch_env)
    yield fleet
    fleet.stop()


@pytest.fixture
def send_client(stack, names):
    from streams.client import SendClient

    return SendClient(stack.bootstrap, names)


def email_request(category: str = "transactional", **payload) -> dict:
    return {"channel": "email", "category": category, "template_id": "welcome", "template_version": "7",
            "payload": {"from": "Acme <no-reply@acme.test>", "to": ["user@example.test"],
                        "subject": "Hello", "html": "<p>Hi</p>", **payload}}


def sms_request(category: str = "transactional") -> dict:
    return {"channel": "sms", "category": category, "template_id": "otp", "template_version": "1",
            "payload": {"to": "+14155550123", "body": "Your code is 123456"}}


def committed_lag(bootstrap: str, group: str, topic: str) -> int:
    """Messages of `topic` not yet committed by `group` (end offset - committed, summed).
    Transient coordinator errors (a group being created or rebalanced) are retried a few times."""
    from confluent_kafka import Consumer, KafkaException, TopicPartition

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
                time.sleep(0.5)
    finally:
        c.close()


def read_topic(bootstrap: str, topic: str, expect: int, timeout: float = 30.0) -> list:
    """Read `expect` messages from the start of `topic` (fails after `timeout`)."""
    import uuid as _uuid

    from confluent_kafka import Consumer

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{_uuid.uuid4().hex}",
                  "auto.offset.reset": "earliest", "enable.auto.commit": False})
    c.subscribe([topic])
    out = []
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
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None
