"""Cluster tests: a three-node Kafka cluster (KRaft, `streams dev up --brokers 3`) and a three-master
Redis Cluster, started once for the session in a private home with ports of their own (never the
shared stack's, never the clusters' defaults), and stopped with `streams dev down --wipe` at the end.

Every test here is marked `cluster` (and `integration`: it needs real servers, so
`pytest -m "not integration"` leaves it out). `pytest -m cluster` runs only these; the first test
waits for the clusters (about 20 s).
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from streams.config import StackConfig
from streams.devtools.stack import (
    CLUSTER_KAFKA_PORT,
    CLUSTER_REDIS_PORT,
    KafkaCluster,
    LocalRedisCluster,
    LocalStack,
)

HERE = os.path.dirname(__file__)
# Kept clear of: the single-node defaults, the clusters' defaults, and the kernel's ephemeral
# ports (32768 and up), which the other tests' connections use.
_RESERVED = [range(16379, 16381), range(19092, 19094), range(CLUSTER_KAFKA_PORT, CLUSTER_KAFKA_PORT + 6),
             range(CLUSTER_REDIS_PORT, CLUSTER_REDIS_PORT + 3), range(CLUSTER_REDIS_PORT + 10000, CLUSTER_REDIS_PORT + 10003)]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if str(item.fspath).startswith(HERE):
            item.add_marker(pytest.mark.integration)
            item.add_marker(pytest.mark.cluster)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_block(size: int, low: int, high: int, bus_offset: int = 0) -> int:
    """A base port whose `size` ports (and, with `bus_offset`, each port + bus_offset) are free."""
    for _ in range(200):
        base = random.randrange(low, high - size)
        ports = [base + i for i in range(size)] + ([base + i + bus_offset for i in range(size)] if bus_offset else [])
        if any(p in r for p in ports for r in _RESERVED):
            continue
        if all(_bindable(p) for p in ports):
            _RESERVED.extend(range(p, p + 1) for p in ports)  # not handed out twice
            return base
    raise RuntimeError(f"no {size} free ports between {low} and {high}")


@dataclass
class ClusterHome:
    """The session's private home: where the clusters keep their layout, data and logs."""

    home: Path
    settings: StackConfig
    env: dict[str, str]
    kafka_base: int
    redis_base: int

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """`streams <args>` as a user runs it, in this home."""
        proc = subprocess.run([sys.executable, "-m", "streams.cli", *args], env=self.env, capture_output=True,
                              text=True, timeout=300)
        if check and proc.returncode != 0:
            raise AssertionError(f"streams {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}")
        return proc


@pytest.fixture(scope="package")
def cluster_home(tmp_path_factory) -> ClusterHome:
    home = tmp_path_factory.mktemp("cluster-home")
    shared = StackConfig.from_env().home / "kafka"  # the Kafka jars, resolved once per machine
    shared.mkdir(parents=True, exist_ok=True)
    (home / "kafka").symlink_to(shared, target_is_directory=True)
    single_kafka, single_redis = free_block(2, 20000, 22000), free_block(1, 20000, 22000)
    settings = StackConfig(home=home, kafka_bootstrap=None, redis_url=None, kafka_port=single_kafka,
                           redis_port=single_redis)
    env = {k: v for k, v in os.environ.items() if k not in ("KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL")}
    env.update(DUAL_RAIL_HOME=str(home), DUAL_RAIL_KAFKA_PORT=str(single_kafka),
               DUAL_RAIL_REDIS_PORT=str(single_redis), LOG_LEVEL="WARNING")
    ch = ClusterHome(home, settings, env, kafka_base=free_block(6, 23000, 32000),
                     redis_base=free_block(3, 20000, 22700, bus_offset=10000))
    yield ch
    # Every node of every cluster, and the single Redis, whatever the tests left running.
    down = ch.cli("dev", "down", "--wipe", check=False)
    assert down.returncode == 0, down.stderr
    leftovers = [s for s in (LocalStack(settings).status()
                             + KafkaCluster(settings, base_port=ch.kafka_base).status()
                             + LocalRedisCluster(settings, base_port=ch.redis_base).status())
                 if s.state != "stopped"]
    assert not leftovers, f"still running after `streams dev down`: {leftovers}"


@dataclass
class RunningKafkaCluster:
    bootstrap: str
    cluster: KafkaCluster
    up_output: dict[str, str]


@pytest.fixture(scope="package")
def kafka_cluster(cluster_home) -> RunningKafkaCluster:
    """`streams dev up --brokers 3`, in the private home (it also starts that home's single Redis)."""
    out = cluster_home.cli("dev", "up", "--brokers", "3", "--kafka-base-port", str(cluster_home.kafka_base)).stdout
    printed = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    cluster = KafkaCluster.existing(cluster_home.settings)
    assert cluster is not None, f"`streams dev up --brokers 3` left no cluster layout in {cluster_home.home}"
    return RunningKafkaCluster(printed["KAFKA_BOOTSTRAP_SERVERS"], cluster, printed)


@pytest.fixture
def healthy_kafka_cluster(kafka_cluster) -> RunningKafkaCluster:
    """The session's Kafka cluster with every node running (a test that stops one starts it again;
    this makes sure of it even when such a test failed half-way)."""
    for status in kafka_cluster.cluster.status():
        if status.state == "stopped":
            kafka_cluster.cluster.start_node(int(status.name.split("-")[1]))
    return kafka_cluster


@pytest.fixture(scope="package")
def redis_cluster(cluster_home) -> LocalRedisCluster:
    """A three-master Redis Cluster in the private home (`streams dev up --redis-cluster` does the same)."""
    cluster = LocalRedisCluster(cluster_home.settings, base_port=cluster_home.redis_base)
    cluster.start()
    return cluster


@pytest.fixture
def healthy_redis_cluster(redis_cluster) -> LocalRedisCluster:
    redis_cluster.start()  # starts whatever node a failed test left stopped; waits for cluster_state:ok
    return redis_cluster


@pytest.fixture(scope="package")
def single_redis_url(cluster_home) -> str:
    """A single Redis of the private home, to compare the Redis Cluster with."""
    return LocalStack(cluster_home.settings).start_redis()
