"""Each long-lived process says on /metrics which role it runs (dispatch_role_running), so that the alert
DispatchRoleGone can tell a role with no copy left from a quiet one."""

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import answers, free_port, local_client, wait_until


def roles_running(text: str) -> dict[str, float]:
    return {s.labels["role"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "dispatch_role_running"}


def test_every_role_names_itself_on_its_metrics(channel_topics, processes):
    """Given a transactional email worker, a marketing email retrier, the lag monitor, the outcome recorder and
    the ingest API (with its bulk process), each serving /metrics,
    When Prometheus would scrape them,
    Then each says the one role it runs: worker.email.transactional, retrier.email.marketing, lag-monitor,
    outcome-recorder, and api at the API's /metrics/ with api-bulk at its /metrics/bulk."""
    channel_topics("email")
    ports = {role: free_port() for role in ("worker.email.transactional", "retrier.email.marketing",
                                            "lag-monitor", "outcome-recorder")}
    processes.worker("email", "transactional", "--metrics-port", str(ports["worker.email.transactional"]))
    processes.start("retrier-email-marketing", "retrier", "--channel", "email", "--lane", "marketing",
                    "--metrics-port", str(ports["retrier.email.marketing"]), ready="retrier consuming")
    processes.start("lag-monitor", "lag-monitor", "--metrics-port", str(ports["lag-monitor"]),
                    ready="lag monitor publishing")
    processes.start("outcome-recorder", "outcome-recorder", "--metrics-port", str(ports["outcome-recorder"]),
                    ready="outcome recorder consuming")
    api_port = free_port()
    processes.start("api", "api", "--port", str(api_port))
    api = local_client(base_url=f"http://127.0.0.1:{api_port}", timeout=10)
    wait_until(lambda: answers(api), 30, "the ingest API")

    for role, port in ports.items():
        said = roles_running(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text)
        assert said == {role: 1.0}, f"port {port}: {said}"
    assert roles_running(api.get("/metrics/").text) == {"api": 1.0}
    # The bulk process starts beside the API and may answer a moment later.
    wait_until(lambda: api.get("/metrics/bulk").status_code == 200, 30, "the bulk process's metrics")
    assert roles_running(api.get("/metrics/bulk").text) == {"api-bulk": 1.0}
