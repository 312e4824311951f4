"""Fault tests: the same real components as the integration tests, with something broken on purpose
(a broker or Redis stopped, a produce failing, Redis data lost). A test that stops a broker or
Redis runs on a private stack of its own (own home, ports and data), never the suite's shared one.

Every test here is marked `faults` (and `integration`: it needs Kafka and Redis).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, replace

import pytest
import redis

from streams.devtools.fleet import Fleet
from streams.devtools.stack import LocalStack
from streams.runtime import Runtime
from streams.topology.admin import TopicAdmin
from streams.topology.spec import channel_specs, load_definitions
from tests.harness import MockProvider, private_stack
from tests.integration.conftest import _mock_b_process, _mock_process, mock_provider  # noqa: F401 - the same mocks


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.integration)
            item.add_marker(pytest.mark.faults)


@dataclass
class FaultStack:
    """A private Kafka and Redis that a test may stop, restart or wipe."""

    local: LocalStack
    bootstrap: str
    redis_url: str

    def stop_kafka(self) -> None:
        self.local.kafka.stop()

    def start_kafka(self) -> None:
        self.local.start_kafka()

    def freeze_kafka(self) -> None:
        """SIGSTOP: the broker answers nothing, yet what reaches its sockets meanwhile it still reads
        and writes once thawed (a long GC pause, a stalled network path)."""
        assert self.local.kafka.signal(signal.SIGSTOP) is not None, "the broker is not running"

    def thaw_kafka(self) -> None:
        self.local.kafka.signal(signal.SIGCONT)

    def stop_redis(self) -> None:
        self.local.redis.stop()

    def start_redis(self) -> None:
        self.local.start_redis()

    def lose_redis_data(self) -> None:
        """`SHUTDOWN NOSAVE`, then an empty Redis in its place (what a restart without persistence,
        or a failover to an empty replica, leaves behind)."""
        try:
            redis.Redis.from_url(self.redis_url).shutdown(nosave=True)
        except redis.ConnectionError:
            pass  # the connection closes as the server exits
        while self.local.redis.pid() is not None:
            time.sleep(0.05)  # the process is exiting; its PID file names it until then
        subprocess.run(["rm", "-rf", str(self.local.redis_data)], check=True)
        self.local.start_redis()

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url)


@pytest.fixture
def fault_stack(tmp_path, stack):
    (tmp_path / "stack").mkdir()
    local = private_stack(tmp_path / "stack")
    try:
        env = local.up()
    except BaseException:
        with contextlib.suppress(Exception):  # the start's own error is the one to see
            local.down(wipe=True)  # what did start (Redis, a JVM not ready in time) is not left running
        raise
    yield FaultStack(local, env["KAFKA_BOOTSTRAP_SERVERS"], env["REDIS_URL"])
    local.down(wipe=True)


@pytest.fixture
def fault_env(fault_stack, namespace, mock_provider: MockProvider) -> dict:  # noqa: F811
    return {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": fault_stack.bootstrap, "REDIS_URL": fault_stack.redis_url,
            "DUAL_RAIL_TOPIC_NAMESPACE": namespace, "RESEND_BASE_URL": mock_provider.url,
            "SMS_BASE_URL": mock_provider.url, "RESEND_API_KEYS": '{"*": "re_test_default"}',
            "SMS_API_KEYS": '{"*": "re_test_sms"}', "PROVIDER_TIMEOUT_S": "2", "LOG_LEVEL": "WARNING"}


@pytest.fixture
def fault_runtime(fault_env):
    runtime = Runtime.from_env(fault_env)
    yield runtime
    runtime.close()


@pytest.fixture
def fault_topics(fault_runtime, namespace):
    """Create a channel's topics (and the shared ones) on the private stack."""

    def _create(channel: str = "email", lane_partitions: int | None = None) -> None:
        specs = channel_specs(load_definitions(namespace=namespace), namespace, (channel,))
        prefix = f"{namespace}notif.{channel}."
        TopicAdmin(fault_runtime.bootstrap).ensure(
            {n: replace(s, partitions=lane_partitions or s.partitions) if n.startswith(prefix) else s
             for n, s in specs.items()})

    return _create


@pytest.fixture
def fault_processes(fault_env, namespace, tmp_path):
    fleet = Fleet(namespace, tmp_path / "logs", base_env=fault_env)
    yield fleet
    fleet.stop()


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    procs = getattr(item, "funcargs", {}).get("fault_processes")
    if report.when == "call" and report.failed and procs is not None:
        report.sections.append(("project process logs", procs.logs(tail=8000)))
