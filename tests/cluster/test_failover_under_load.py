"""A broker of the three-node cluster killed in the middle of a blast, with every dispatch role
running on topics of the cluster profile (3 replicas, min.insync.replicas 2): nothing is lost,
nothing is sent twice, and the OTPs' latency through the failover is recorded."""

import math
import os
import time
import uuid

import pytest
from confluent_kafka.admin import AdminClient

from streams.devtools.fleet import Fleet
from tests.harness import committed_lag, email_request, wait_until
from tests.integration.conftest import _mock_b_process, _mock_process, mock_provider  # noqa: F401 - shared mocks

BLAST = 4_000
OTP_RATE = 5.0


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)] if ordered else float("nan")


def _leader_of(bootstrap: str, topic: str) -> int:
    md = AdminClient({"bootstrap.servers": bootstrap}).list_topics(topic, timeout=10)
    return md.topics[topic].partitions[0].leader


def _controller(cluster_home) -> int:
    first = cluster_home.cli("dev", "quorum").stdout.splitlines()[0]  # "leader N (epoch E), high watermark H"
    return int(first.split()[1])


@pytest.mark.parametrize("victim", ["lane leader", "controller leader"])
def test_a_broker_killed_mid_blast_loses_and_doubles_nothing(victim, healthy_kafka_cluster, cluster_home,
                                                            single_redis_url, mock_provider, tmp_path):  # noqa: F811
    """Given the email dispatch fleet (both lanes' workers and retriers, the lag monitor) on the three-broker cluster
    with the cluster topic profile, a 4,000-email blast and OTPs at 5 a second,
    When the broker leading the transactional lane's partition 0 (or the active controller) is killed with SIGKILL
    mid-blast and started again 15 s later,
    Then every send is delivered exactly once and both lanes are committed to their end; the OTP p99 through the
    failover is printed."""
    bootstrap = healthy_kafka_cluster.bootstrap
    mock_provider.reset(rate=100, latency_ms=20)
    namespace = f"f{uuid.uuid4().hex[:8]}."
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": bootstrap, "REDIS_URL": single_redis_url,
           "DUAL_RAIL_TOPIC_PROFILE": "cluster", "RESEND_BASE_URL": mock_provider.url,
           "RESEND_API_KEYS": '{"*": "re_test_default"}', "LOG_LEVEL": "WARNING"}
    with Fleet(namespace, tmp_path / "logs", base_env=env) as fleet:
        fleet.create_topics(("email",))
        rt = fleet.runtime
        limits = rt.limit_store()
        limits.set_provider("resend", 100, 100, reserve=10)
        limits.set_tenant("resend", "*", 100_000, 50)
        fleet.start("lag-monitor", "lag-monitor", "--interval", "0.25", ready="lag monitor publishing")
        for lane in ("transactional", "marketing"):
            fleet.worker("email", lane)
            fleet.retrier("email", lane)
        client = rt.send_client()
        try:
            ids: list[str] = []
            for _ in range(BLAST // 1000):
                ids += client.publish_batch("blaster", [email_request("marketing")] * 1000)
            otps: dict[str, float] = {}
            node = _leader_of(bootstrap, rt.names.lane("email", "transactional")) if victim == "lane leader" \
                else _controller(cluster_home)
            started = time.monotonic()
            killed_at = restarted_at = None
            while time.monotonic() - started < 40:
                asked_at = time.time()  # before the publish: waiting for the broker's ack is part of the journey
                [otp] = client.publish_batch("shop", [email_request("transactional")])
                otps[otp] = asked_at
                elapsed = time.monotonic() - started
                if killed_at is None and elapsed >= 10:
                    cluster_home.cli("dev", "kill-node", str(node), "--signal", "KILL")
                    killed_at = time.time()
                if restarted_at is None and elapsed >= 25:
                    cluster_home.cli("dev", "start-node", str(node))
                    restarted_at = time.time()
                time.sleep(1 / OTP_RATE)  # pacing the OTP stream
            ids += list(otps)
            wait_until(lambda: set(ids) <= set(mock_provider.stats(deliveries=True)["deliveries"]), 180,
                       "every send to be delivered", interval=1.0)
            for lane in ("marketing", "transactional"):
                wait_until(lambda lane=lane: committed_lag(bootstrap, rt.names.group("email", lane),
                                                           rt.names.lane("email", lane)) == 0, 120,
                           f"the {lane} lane to be committed to its end", interval=1.0)
            stats = mock_provider.stats(deliveries=True)
            during = [stats["deliveries"][s][0] - t for s, t in otps.items() if killed_at <= t <= restarted_at]
            after = [stats["deliveries"][s][0] - t for s, t in otps.items() if t > restarted_at]
            print(f"{victim} (node {node}) killed: OTP p99 during the failover {_p99(during) * 1000:.0f} ms over "
                  f"{len(during)} OTPs (each, ms: {[round(d * 1000) for d in during]}); p99 after the restart "
                  f"{_p99(after) * 1000:.0f} ms; {len(ids)} sends, duplicates {stats['duplicate_deliveries']}")
            assert stats["duplicate_deliveries"] == 0, stats["duplicated_sends"]
        finally:
            client.close()  # its producer's thread would log into a closed capture after the cluster stops
