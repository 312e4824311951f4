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

from streams.names import TopicNames


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
        from streams.devtools.stack import LocalStack

        env = LocalStack().up()
        yield Stack(env["KAFKA_BOOTSTRAP_SERVERS"], env["REDIS_URL"])


@pytest.fixture
def namespace() -> str:
    """A unique topic/group/Redis-key prefix for one test."""
    return f"t{uuid.uuid4().hex[:10]}."


@pytest.fixture
def names(namespace) -> TopicNames:
    return TopicNames(namespace)


@pytest.fixture
def redis_client(stack):
    from streams.redis_client import connect

    return connect(stack.redis_url)  # a single Redis, or a Redis Cluster (redis+cluster://...)


@pytest.fixture
def create_topics(stack):
    """Create topics for one test (deleted afterwards): {name: partitions} with one config, or
    TopicSpec objects as they are."""
    from streams.topology.admin import TopicAdmin
    from streams.topology.spec import TopicSpec

    admin = TopicAdmin(stack.bootstrap)
    created: list[str] = []

    def _create(topics: dict[str, int] | list[TopicSpec], config: dict[str, str] | None = None) -> None:
        if isinstance(topics, dict):
            topics = [TopicSpec(n, p, 1, dict(config or {})) for n, p in topics.items()]
        specs = {t.name: t for t in topics}
        admin.ensure(specs)
        created.extend(n for n in specs if n not in created)  # a topic shared by two channels is deleted once

    yield _create
    try:
        admin.delete(created)
    except Exception:  # noqa: BLE001 - best effort clean-up
        pass
