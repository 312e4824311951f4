"""The endpoint-health app started while the broker is away: it waits for it, then creates its
changelog topic and starts, with no restart by hand."""

import time

from streams.topology.admin import TopicAdmin
from tests.harness import free_port, metric, wait_until


def test_endpoint_health_started_during_a_broker_outage_waits_then_starts(
        fault_stack, fault_topics, fault_processes, names):
    """Given the webhook topics on a private stack whose broker is then stopped,
    When a copy of the endpoint-health app is started, and the broker is started again 10 s later,
    Then meanwhile the copy stays up, reports Kafka down (dispatch_dependency_down) and says in its log that
    its changelog topic is not ready; once the broker is back it creates the changelog topic (compacted, one
    partition per attempts partition) and starts consuming."""
    fault_topics("webhook")
    fault_stack.stop_kafka()
    port = free_port()
    proc = fault_processes.start("endpoint-health", "endpoint-health", "--metrics-port", str(port))
    [member] = [m for m in fault_processes.members if m.name == "endpoint-health"]
    wait_until(lambda: "not ready" in member.log.read_text(errors="replace"), 60, "the copy to report the broker away")
    wait_until(lambda: metric(port, "dispatch_dependency_down", role="endpoint-health", dependency="kafka") == 1, 30,
               "the copy to report Kafka down")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # an outage of a while: the copy must not give up
        assert proc.poll() is None, member.log.read_text(errors="replace")[-2000:]
        time.sleep(0.5)
    fault_stack.start_kafka()
    wait_until(lambda: "endpoint health consuming" in member.log.read_text(errors="replace"), 120,
               "the copy to start consuming")
    changelog = f"{names.endpoint_health_app}-health-changelog"
    state = TopicAdmin(fault_stack.bootstrap).state([changelog])[changelog]
    assert state.partitions == 6 and state.overrides.get("cleanup.policy") == "compact"
    assert metric(port, "dispatch_dependency_down", role="endpoint-health", dependency="kafka") == 0
    assert proc.poll() is None
