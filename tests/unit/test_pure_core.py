"""The pure core imports no Kafka, Redis, HTTP, web or metrics library: each module is imported in a
fresh interpreter and the test fails if any of those libraries was loaded."""

import subprocess
import sys

import pytest

PURE = ["streams.gate.token_bucket", "streams.retry.policy", "streams.lag.yield_policy",
        "streams.dispatch.tenant_queues", "streams.dispatch.intake", "streams.providers.outcome",
        "streams.providers.registry", "streams.send", "streams.offsets", "streams.lanes", "streams.names",
        "streams.topology.spec", "streams.config", "streams.errors", "streams.health.rules", "streams.outcomes",
        "streams.webhooks.model", "streams.webhooks.fanout"]
IO_LIBRARIES = ["confluent_kafka", "redis", "httpx", "fastapi", "starlette", "prometheus_client", "faust"]


@pytest.mark.parametrize("module", PURE)
def test_pure_module_loads_no_io_library(module):
    probe = (f"import sys, {module}\n"
             f"print(','.join(m for m in {IO_LIBRARIES!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{module} loads {out.stdout.strip()}"
