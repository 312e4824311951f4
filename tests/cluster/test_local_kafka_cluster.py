"""`streams dev up --brokers 3`: three combined controller+broker nodes, a quorum of three, and a
broker that can be killed and started again without losing an acknowledged write."""

import uuid

import pytest
from confluent_kafka import Consumer
from confluent_kafka.admin import AdminClient

from streams.kafka_client import durable_producer
from streams.topology.admin import TopicAdmin
from streams.topology.spec import TopicSpec, topic_profile
from tests.harness import wait_until

pytestmark = pytest.mark.cluster


def test_three_brokers_and_a_controller_quorum_of_three(kafka_cluster, cluster_home):
    """Given `streams dev up --brokers 3 --kafka-base-port B` run in a private home,
    When its output, the cluster metadata, the KRaft quorum and `streams dev status` are read,
    Then it printed the three nodes' addresses (B, B+2, B+4) and DUAL_RAIL_TOPIC_PROFILE=cluster, the metadata lists
    brokers 1, 2 and 3 at those addresses, the metadata quorum has voters 1, 2 and 3 with a leader among them and
    no observer, and `streams dev status` lists kafka-1..3 running with their addresses and exits 0."""
    base = cluster_home.kafka_base
    addresses = [f"127.0.0.1:{base + 2 * i}" for i in range(3)]
    assert kafka_cluster.up_output == {"KAFKA_BOOTSTRAP_SERVERS": ",".join(addresses),
                                       "REDIS_URL": f"redis://127.0.0.1:{cluster_home.settings.redis_port}/0",
                                       "DUAL_RAIL_TOPIC_PROFILE": "cluster"}

    md = AdminClient({"bootstrap.servers": kafka_cluster.bootstrap}).list_topics(timeout=10)
    assert {b.id: f"{b.host}:{b.port}" for b in md.brokers.values()} == dict(zip([1, 2, 3], addresses, strict=True))

    quorum = kafka_cluster.cluster.quorum()
    assert set(quorum.voters) == {1, 2, 3}
    assert quorum.leader_id in quorum.voters and quorum.observers == {}

    status = cluster_home.cli("dev", "status")
    lines = {line.split()[0]: line.split()[1:] for line in status.stdout.splitlines()}
    for n, address in enumerate(addresses, start=1):
        assert lines[f"kafka-{n}"][0] == "running" and lines[f"kafka-{n}"][-1] == address, status.stdout


def test_a_killed_broker_loses_no_acknowledged_write_and_rejoins(healthy_kafka_cluster, cluster_home):
    """Given a topic of 3 partitions with 3 replicas and min.insync.replicas=2 (the cluster profile) and 200 records
    produced with acks=all,
    When broker 3 is killed with SIGKILL (`streams dev kill-node 3 --signal KILL`), 200 more records are produced,
    and it is started again (`streams dev start-node 3`),
    Then every one of the 400 records is acknowledged while it is down, `streams dev status` reports kafka-3
    stopped (exit 3) meanwhile, all 400 are read back afterwards, and every partition's ISR is the 3 replicas
    again."""
    bootstrap = healthy_kafka_cluster.bootstrap
    topic = f"c{uuid.uuid4().hex[:8]}.failover"
    cluster = topic_profile("cluster")
    admin = TopicAdmin(bootstrap)
    admin.ensure({topic: TopicSpec(topic, 3, cluster.replication_factor,
                                   {"min.insync.replicas": str(cluster.min_insync_replicas)})})
    try:
        producer = durable_producer(bootstrap, **{"delivery.timeout.ms": 60_000})
        failed: list = []

        def produce(first: int, count: int) -> None:
            for i in range(first, first + count):
                producer.produce(topic, key=str(i % 7).encode(), value=str(i).encode(),
                                 on_delivery=lambda err, _msg: err and failed.append(err))
            assert producer.flush(90) == 0, "records still unacknowledged"

        produce(0, 200)

        # When broker 3 crashes
        assert cluster_home.cli("dev", "kill-node", "3", "--signal", "KILL").stdout.strip() == "kafka-3 stopped (SIGKILL)"
        status = cluster_home.cli("dev", "status", check=False)
        assert status.returncode == 3 and any(line.split()[:2] == ["kafka-3", "stopped"]
                                              for line in status.stdout.splitlines()), status.stdout
        produce(200, 200)
        assert failed == []

        # And it comes back
        assert cluster_home.cli("dev", "start-node", "3").stdout.startswith("kafka-3 running")

        def full_isr():
            parts = admin.admin.list_topics(topic, timeout=10).topics[topic].partitions.values()
            return all(sorted(p.isrs) == [1, 2, 3] for p in parts)

        wait_until(full_isr, 60, "every partition's ISR to be 3 replicas again")
        consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{uuid.uuid4().hex}",
                             "auto.offset.reset": "earliest", "enable.auto.commit": False})
        consumer.subscribe([topic])
        seen: set[int] = set()
        try:
            wait_until(lambda: seen.update(int(m.value()) for m in consumer.consume(500, 0.5) if not m.error())
                       or len(seen) == 400, 60, "all 400 records to be read back")
        finally:
            consumer.close()
        assert seen == set(range(400))
    finally:
        admin.delete([topic])
