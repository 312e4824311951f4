"""Fixtures for tests against real processes: the mock provider as a real HTTP server, the
project's roles as real processes (`streams.devtools.fleet.Fleet`), topics per test namespace.

Every test in this folder is marked `integration` (it needs Kafka and Redis), so
`pytest -m "not integration"` runs only the unit tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest

from streams.devtools.fleet import Fleet
from tests.harness import MockEndpoint, MockProvider, answers, free_port, wait_until


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def _mock_process(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("mock-provider") / "mock-provider.log"
    with open(log, "wb") as out:  # a file, not an unread pipe that could fill and block the server
        proc = subprocess.Popen([sys.executable, "-m", "streams.cli", "mock-provider", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT)
    mock = MockProvider(port, proc)
    wait_until(mock.answering, 20, "the mock provider to answer")
    yield mock
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="session")
def _mock_b_process(tmp_path_factory):
    """A second mock provider instance: the second SMS provider (token auth, its own protocol)."""
    port = free_port()
    log = tmp_path_factory.mktemp("mock-provider-b") / "mock-provider-b.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "streams.cli", "mock-provider", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT)
    mock = MockProvider(port, proc)
    wait_until(mock.answering, 20, "the second mock provider to answer")
    yield mock
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="session")
def _mock_endpoint_process(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("mock-endpoint") / "mock-endpoint.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "streams.cli", "mock-endpoint", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT)
    receiver = MockEndpoint(port, proc)
    wait_until(lambda: answers(receiver.http, "/_mock/stats"), 20, "the mock endpoint to answer")
    yield receiver
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def mock_endpoint(_mock_endpoint_process):
    """The mock webhook receiver, reset for this test."""
    _mock_endpoint_process.reset()
    return _mock_endpoint_process


@pytest.fixture
def mock_provider(_mock_process, _mock_b_process):
    """The mock provider (and the second SMS provider's), reset for this test. After the test: no
    request reached a forbidden path of either."""
    _mock_process.reset()
    _mock_b_process.reset()
    yield _mock_process
    for mock in (_mock_process, _mock_b_process):
        stats = mock.stats()
        assert stats["forbidden"] == 0, f"requests reached forbidden provider paths: {stats['forbidden_paths']}"


@pytest.fixture
def mock_provider_b(mock_provider, _mock_b_process):
    """The second SMS provider's mock (token auth), reset for this test."""
    return _mock_b_process


TEST_SECRET_KEYS = "test-2:l3aeICTGIosQMSpDgHHUx2QKhJetyLPINQ48A7pum0I=,test-1:CLLZmWPbcg4fX8wpHzbhJEL3X6STXZRDo25pysubxmk="


@pytest.fixture
def dispatch_env(stack, namespace, mock_provider, _mock_b_process) -> dict:
    """Environment for the project's processes in this test (own namespace, the mock provider)."""
    return {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": stack.bootstrap, "REDIS_URL": stack.redis_url,
            "DUAL_RAIL_TOPIC_NAMESPACE": namespace, "RESEND_BASE_URL": mock_provider.url,
            "SMS_BASE_URL": mock_provider.url, "RESEND_API_KEYS": '{"*": "re_test_default"}',
            "SMS_B_BASE_URL": _mock_b_process.url,
            "SMS_B_CREDENTIALS": '{"client_id": "mock-client", "client_secret": "mock-secret"}',
            "SMS_API_KEYS": '{"*": "re_test_sms"}', "PROVIDER_TIMEOUT_S": "2", "LOG_LEVEL": "WARNING",
            # Webhook receivers in tests are the mock endpoint on loopback, allowed explicitly.
            "WEBHOOK_REQUIRE_HTTPS": "0", "WEBHOOK_ALLOW_HOSTS": "127.0.0.1",
            # Signing secrets sealed at rest, as production should run (keys for tests only).
            "WEBHOOK_SECRET_KEYS": TEST_SECRET_KEYS}


@pytest.fixture
def channel_topics(namespace, create_topics):
    """Create one channel's lane and retry topics plus notif.dlq, notif.outcomes and notif.lag, as
    defined in topics/ (configs included), in this test's namespace; deleted afterwards."""
    from streams.topology.spec import channel_specs, load_definitions

    def _create(channel: str, lane_partitions: int | None = None) -> None:
        specs = channel_specs(load_definitions(namespace=namespace), namespace, (channel,))
        lane_prefix = f"{namespace}notif.{channel}."
        create_topics([replace(s, partitions=lane_partitions or s.partitions) if n.startswith(lane_prefix) else s
                       for n, s in specs.items()])

    return _create


@pytest.fixture
def oplog_topic(names, create_topics):
    """A compacted operator log topic of the test's own."""
    create_topics({names.operator: 1}, {"cleanup.policy": "compact"})
    return names.operator


@pytest.fixture
def limits(redis_client, namespace):
    from streams.gate.limits import LimitStore

    return LimitStore(redis_client, namespace)


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    procs = getattr(item, "funcargs", {}).get("processes")
    if report.when == "call" and report.failed and procs is not None:
        report.sections.append(("project process logs", procs.logs(tail=8000)))


@pytest.fixture
def processes(dispatch_env, namespace, tmp_path):
    """The project's processes for one test (streams.devtools.fleet.Fleet): log files shown on
    failure, SIGTERM then SIGKILL when the test ends."""
    fleet = Fleet(namespace, tmp_path / "logs", base_env=dispatch_env)
    yield fleet
    fleet.stop()


@pytest.fixture
def send_client(stack, names):
    from streams.ingest.sdk import SendClient

    client = SendClient(stack.bootstrap, names)
    yield client
    client.close()
