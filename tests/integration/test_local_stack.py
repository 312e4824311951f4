"""`streams dev up|status|down` on a second, private stack (own home and ports)."""

import socket

import pytest

from streams.config import StackConfig
from streams.devtools.stack import LocalStack
from streams.errors import StackError
from tests import harness
from tests.harness import free_port_pair


@pytest.fixture
def private_stack(tmp_path, stack):
    # The session stack is up first, so the jar cache this stack reuses exists.
    local = harness.private_stack(tmp_path)
    yield local
    local.down(wipe=True)


def test_up_twice_reuses_status_reports_and_down_stops_only_ours(private_stack):
    """Given a private local stack with its own home directory and free ports,
    When `up` is run twice, followed by `status` and `down`,
    Then the second `up` returns the same result and reuses the same Kafka and Redis processes, status shows both
    running with their pids, and `down` stops exactly kafka and redis, which are reported stopped afterwards."""
    first = private_stack.up()
    kafka_pid, redis_pid = private_stack.kafka.pid(), private_stack.redis.pid()
    assert kafka_pid and redis_pid

    second = private_stack.up()

    assert second == first
    assert (private_stack.kafka.pid(), private_stack.redis.pid()) == (kafka_pid, redis_pid)
    states = {s.name: s.state for s in private_stack.status()}
    assert states == {"kafka": f"running (pid {kafka_pid})", "redis": f"running (pid {redis_pid})"}

    assert sorted(private_stack.down()) == ["kafka", "redis"]
    assert {s.state for s in private_stack.status()} == {"stopped"}


def test_taken_port_is_reported_by_number(private_stack):
    """Given a private local stack whose Redis port is already held by another socket,
    When Redis is started,
    Then it fails with an error naming that port number as taken."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", private_stack.settings.redis_port))
        squatter.listen()
        with pytest.raises(StackError, match=f"port {private_stack.settings.redis_port} is taken"):
            private_stack.start_redis()


def test_missing_maven_is_named(tmp_path, monkeypatch):
    """Given a PATH with neither java nor mvn on it,
    When the local stack looks for the Kafka libraries,
    Then it fails saying `java` was not found on PATH and that the local Kafka needs a JDK 17."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no java, no mvn
    local = LocalStack(StackConfig(home=tmp_path, kafka_bootstrap=None, redis_url=None,
                                     kafka_port=free_port_pair(), redis_port=free_port_pair()))
    with pytest.raises(StackError, match="`java` was not found on PATH: the local Kafka needs a JDK 17"):
        local.kafka_libs()


def test_environment_addresses_win(tmp_path):
    """Given KAFKA_BOOTSTRAP_SERVERS and REDIS_URL set in the environment,
    When the local stack is brought up,
    Then it returns exactly those addresses and reports both services as external."""
    local = LocalStack(StackConfig.from_env({"DUAL_RAIL_HOME": str(tmp_path),
                                               "KAFKA_BOOTSTRAP_SERVERS": "broker:9092",
                                               "REDIS_URL": "redis://cache:6379/0"}))
    assert local.up() == {"KAFKA_BOOTSTRAP_SERVERS": "broker:9092", "REDIS_URL": "redis://cache:6379/0"}
    assert {s.state for s in local.status()} == {"external"}
