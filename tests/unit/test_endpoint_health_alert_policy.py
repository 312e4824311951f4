"""The endpoint-health app sends its alerts under the operator's retry policies, as ingest does."""

import asyncio
from pathlib import Path
from types import SimpleNamespace

import orjson

from streams.config import Config
from streams.health.app import EndpointHealthApp
from streams.health.rules import Alert, Health


def test_an_alert_names_a_policy_of_the_operators_policy_file(tmp_path):
    """Given an operator's policy file whose transactional email policy is named `receipts` (none named
    `transactional`, the packaged file's name),
    When the endpoint-health app sends a "stopped" alert,
    Then the alert's send names `receipts` (before: `transactional`, from the packaged file, which the email workers
    of this deployment do not know: every alert dead-lettered `unknown_policy`, and counted as sent)."""
    packaged = Path(__file__).resolve().parents[2] / "streams" / "retry" / "policies.toml"
    text = packaged.read_text().replace("[policy.transactional]", "[policy.receipts]").replace(
        'product = "transactional"', 'product = "receipts"').replace(
        'transactional = "transactional"', 'transactional = "receipts"')
    (tmp_path / "policies.toml").write_text(text)
    config = Config.from_env({"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1", "REDIS_URL": "redis://127.0.0.1:1/0",
                              "DUAL_RAIL_RETRY_POLICIES": str(tmp_path / "policies.toml")})
    directory = SimpleNamespace(members={"acme": ["ops@acme.test"]}, endpoints={})
    produced: list[tuple[str, bytes]] = []

    async def scenario() -> None:
        app = EndpointHealthApp(config, directory, data_dir=tmp_path / "data")  # type: ignore[arg-type]

        async def record(topic: str, key: bytes, value: bytes, headers: list) -> None:
            produced.append((topic, value))

        app._produce = record  # type: ignore[method-assign]
        health = Health("ep_1", tenant="acme", state="degraded", last_error="HTTP 500")
        await app._send_alert(health, Alert("stopped", "alert-1", 1_700_000_000_000))

    asyncio.run(scenario())
    [(topic, value)] = produced
    assert topic == config.names.lane("email", "transactional")
    assert orjson.loads(value)["policy"] == "receipts"


def test_a_degradation_is_published_before_its_alert(tmp_path):
    """Given an endpoint's tenth failure (degraded, and a "stopped" alert to send) and an email lane the broker does
    not take records on,
    When the endpoint-health app acts on it,
    Then the degraded state is published first (deliveries to the endpoint stop), and the alert's failure comes after
    it (before: the alert went first, and its produce, retried until the lane takes it, held the degradation back)."""
    from streams.health.rules import Outcome

    config = Config.from_env({"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1", "REDIS_URL": "redis://127.0.0.1:1/0"})
    directory = SimpleNamespace(members={"acme": ["ops@acme.test"]}, endpoints={})
    produced: list[str] = []

    async def scenario() -> None:
        app = EndpointHealthApp(config, directory, data_dir=tmp_path / "data")  # type: ignore[arg-type]

        async def produce(topic: str, key: bytes, value: bytes, headers: list) -> None:
            produced.append(topic)
            if topic == config.names.lane("email", "transactional"):
                raise RuntimeError("the lane takes no records (test)")

        app._produce = produce  # type: ignore[method-assign]
        health = Health("ep_1", tenant="acme", state="degraded", last_error="HTTP 500")
        outcome = Outcome(health, True, (Alert("stopped", "alert-1", 1_700_000_000_000),))
        try:
            await app._act(outcome, {"kind": "attempt"})
        except RuntimeError:
            pass

    asyncio.run(scenario())
    assert produced == [config.names.endpoint_state, config.names.lane("email", "transactional")]


def test_a_row_learns_its_attempts_partition_at_its_next_event(tmp_path):
    """Given an endpoint's row written before rows remembered their attempts partition (applied up to offset 900),
    When a delivered attempt of it is applied from partition 3 at offset 950 (its health does not change),
    Then the row is written with its partition (before: only a change of health wrote a row, so it never learned
    it, and after the topic grew its events at lower offsets of another partition were all taken for replays)."""
    config = Config.from_env({"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1", "REDIS_URL": "redis://127.0.0.1:1/0"})
    directory = SimpleNamespace(members={}, endpoints={}, deleted={}, caught_up=True, poll=lambda: None)
    table = {"ep_1": {"endpoint_id": "ep_1", "tenant": "acme", "applied_upto": 900}}  # no applied_partition

    async def scenario() -> None:
        app = EndpointHealthApp(config, directory, data_dir=tmp_path / "data")  # type: ignore[arg-type]
        app.table = table  # type: ignore[assignment]
        event = SimpleNamespace(key=b"ep_1", value=orjson.dumps({"kind": "attempt", "outcome": "delivered",
                                                                 "tenant_id": "acme", "at_ms": 1}),
                                message=SimpleNamespace(topic=config.names.webhook_attempts, partition=3, offset=950))
        await app._apply(event)

    asyncio.run(scenario())
    assert (table["ep_1"]["applied_upto"], table["ep_1"]["applied_partition"]) == (950, 3)


def test_a_send_the_broker_does_not_answer_says_the_broker_is_down_while_it_waits(tmp_path, caplog):
    """Given the endpoint-health app publishing a state change the broker neither acknowledges nor refuses (a
    partition without its leader, too few in-sync replicas: faust's producer waits 20 minutes before it gives up),
    When the send has waited past the app's unacknowledged time (shortened here),
    Then `dispatch_dependency_down{role="endpoint-health", dependency="kafka"}` is 1 and a warning names the topic
    while the send goes on waiting (not cancelled, not sent again); once the broker acknowledges it the gauge is 0
    (before: nothing was said for those 20 minutes)."""
    import logging

    from prometheus_client import REGISTRY

    config = Config.from_env({"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1", "REDIS_URL": "redis://127.0.0.1:1/0"})
    directory = SimpleNamespace(members={}, endpoints={}, deleted={})
    down = {"role": "endpoint-health", "dependency": "kafka"}
    sends = []

    async def scenario() -> None:
        app = EndpointHealthApp(config, directory, data_dir=tmp_path / "data")  # type: ignore[arg-type]
        app.unacknowledged_s = 0.01
        answer = asyncio.get_running_loop().create_future()

        async def send_and_wait(*args):
            sends.append(args[0])
            return await answer

        app.app._producer = SimpleNamespace(send_and_wait=send_and_wait)
        producing = asyncio.ensure_future(app._produce("notif.endpoint.state", b"ep_1", b"{}", []))

        async def said_down() -> None:
            while REGISTRY.get_sample_value("dispatch_dependency_down", down) != 1:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(said_down(), timeout=5)
        assert not producing.done()
        answer.set_result(None)
        await producing

    with caplog.at_level(logging.WARNING):
        asyncio.run(scenario())
    assert sends == ["notif.endpoint.state"]
    assert REGISTRY.get_sample_value("dispatch_dependency_down", down) == 0
    assert any("publishing to notif.endpoint.state: no acknowledgement from the broker after" in r.getMessage()
               for r in caplog.records)
