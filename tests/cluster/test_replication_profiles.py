"""Topic replication profiles on the three-broker cluster: the cluster profile creates every topic with
3 replicas and min.insync.replicas=2, and raises topics created with one replica by partition
reassignment, planned first, without losing a record."""

import shutil
import uuid
from collections import Counter

import pytest
from confluent_kafka import Consumer

from streams.kafka_client import durable_producer
from streams.topology.admin import TopicAdmin, list_partition_reassignments
from streams.topology.spec import REPO_TOPICS, TopicSpec, load_definitions, plan

pytestmark = pytest.mark.cluster


@pytest.fixture
def topic_namespace(healthy_kafka_cluster):
    namespace = f"p{uuid.uuid4().hex[:10]}."
    yield namespace
    admin = TopicAdmin(healthy_kafka_cluster.bootstrap)
    admin.delete(sorted(admin.state(list(load_definitions(namespace=namespace)))))


def test_cluster_profile_creates_every_topic_with_three_replicas_two_in_sync(healthy_kafka_cluster, topic_namespace):
    """Given the repository's topic definitions (replication_factor = 1 as written) loaded with the cluster profile,
    and an empty namespace on the three-broker cluster,
    When the plan is applied (what `streams topics apply --profile cluster` does),
    Then every topic exists with 3 replicas on every partition, all in sync, and min.insync.replicas=2, the topics'
    own configs are kept, and a second plan is empty."""
    admin = TopicAdmin(healthy_kafka_cluster.bootstrap)
    specs = load_definitions(namespace=topic_namespace, profile="cluster")
    assert Counter(c.kind for c in plan(specs, admin.state(list(specs)))) == {"create": len(specs)}

    admin.apply(plan(specs, admin.state(list(specs))), specs)

    state = admin.state(list(specs))
    assert set(state) == set(specs)
    assert {s.replication_factor for s in state.values()} == {3}
    assert {s.overrides.get("min.insync.replicas") for s in state.values()} == {"2"}
    assert state[f"{topic_namespace}notif.lag"].overrides["cleanup.policy"] == "compact"
    md = admin.admin.list_topics(timeout=10)
    for name in specs:
        for p in md.topics[name].partitions.values():
            assert len(p.replicas) == 3 and sorted(p.isrs) == sorted(p.replicas), (name, p.id, p.replicas, p.isrs)
    assert plan(specs, admin.state(list(specs))) == []


def test_cluster_profile_over_single_replica_topics_is_planned_then_reassigned(healthy_kafka_cluster, topic_namespace,
                                                                           tmp_path):
    """Given the system topics created as written (1 replica, no min.insync.replicas) on the three-broker cluster, and
    100 records on notif.outcomes,
    When the cluster profile is planned, applied, and planned again,
    Then the first plan lists, for every topic, `add_replicas` 1 -> 3 and `set_config` min.insync.replicas -> 2 and
    refuses nothing; after apply no reassignment is in progress, every partition has 3 in-sync replicas led by its
    former only replica, min.insync.replicas is 2, the 100 records are all there, and the second plan is empty;
    planning the dev profile afterwards refuses to lower the replication factor, saying why."""
    bootstrap = healthy_kafka_cluster.bootstrap
    admin = TopicAdmin(bootstrap)
    shutil.copy(REPO_TOPICS / "system.toml", tmp_path / "system.toml")  # what `streams topics apply --dir` reads
    written = load_definitions(tmp_path, namespace=topic_namespace)
    assert {s.replication_factor for s in written.values()} == {1} and f"{topic_namespace}notif.outcomes" in written
    admin.apply(plan(written, admin.state(list(written))), written)
    leaders_before = {(n, p.id): p.replicas[0] for n in written
                      for p in admin.admin.list_topics(n, timeout=10).topics[n].partitions.values()}
    outcomes = f"{topic_namespace}notif.outcomes"
    producer = durable_producer(bootstrap)
    for i in range(100):
        producer.produce(outcomes, key=str(i).encode(), value=str(i).encode())
    assert producer.flush(30) == 0

    # When the cluster profile is planned
    clustered = load_definitions(tmp_path, namespace=topic_namespace, profile="cluster")
    changes = plan(clustered, admin.state(list(clustered)))
    assert {(c.topic, c.kind, c.key) for c in changes} == (
        {(n, "add_replicas", "") for n in written} | {(n, "set_config", "min.insync.replicas") for n in written})
    assert f"add_replicas    {outcomes}: replication factor 1 -> 3 (partition reassignment" in "\n".join(map(str, changes))

    # And applied
    admin.apply(changes, clustered)

    assert list_partition_reassignments(bootstrap, {n: list(range(s.partitions)) for n, s in written.items()}) == []
    md = admin.admin.list_topics(timeout=10)
    for name in written:
        for p in md.topics[name].partitions.values():
            assert len(p.replicas) == 3 and sorted(p.isrs) == sorted(p.replicas), (name, p.id, p.replicas, p.isrs)
            assert p.replicas[0] == p.leader == leaders_before[(name, p.id)]
    assert {s.overrides.get("min.insync.replicas") for s in admin.state(list(written)).values()} == {"2"}
    assert plan(clustered, admin.state(list(clustered))) == []
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{uuid.uuid4().hex}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    consumer.subscribe([outcomes])
    seen: set[bytes] = set()
    try:
        for _ in range(60):
            seen.update(m.value() for m in consumer.consume(500, 0.5) if not m.error())
            if len(seen) == 100:
                break
    finally:
        consumer.close()
    assert seen == {str(i).encode() for i in range(100)}

    # And lowering it again is refused, with the reason
    dev = load_definitions(tmp_path, namespace=topic_namespace, profile="dev")
    refused = [c for c in plan(dev, admin.state(list(dev))) if c.kind == "refused"]
    assert {c.topic for c in refused} == set(written)
    assert "replication factor 3 -> 1: lowering it throws away copies of every partition" in refused[0].detail


def test_a_topic_created_before_its_profile_gets_its_replicas_when_its_role_starts(healthy_kafka_cluster,
                                                                                    topic_namespace):
    """Given the endpoint-health changelog (a topic not in topics/*.toml, made by the role itself) created on the
    three-broker cluster with one replica, as a first start without the cluster profile makes it,
    When the role starts again with the profile (`create_missing` with 3 replicas and min.insync.replicas 2),
    Then the topic has 3 in-sync replicas on every partition and min.insync.replicas 2 (before: it kept its one
    copy for good, and `topics apply` never sees it); a start without the profile afterwards leaves it as is."""
    admin = TopicAdmin(healthy_kafka_cluster.bootstrap)
    name = f"{topic_namespace}endpoint-health-changelog"
    admin.create_missing({name: TopicSpec(name, 3, 1, {"cleanup.policy": "compact"})})
    assert admin.state([name])[name].replication_factor == 1

    admin.create_missing({name: TopicSpec(name, 3, 3, {"cleanup.policy": "compact", "min.insync.replicas": "2"})})

    state = admin.state([name])[name]
    assert (state.replication_factor, state.overrides.get("min.insync.replicas")) == (3, "2")
    assert state.overrides["cleanup.policy"] == "compact"
    assert list_partition_reassignments(healthy_kafka_cluster.bootstrap, {name: [0, 1, 2]}) == []
    for p in admin.admin.list_topics(name, timeout=10).topics[name].partitions.values():
        assert len(p.replicas) == 3 and sorted(p.isrs) == sorted(p.replicas), (p.id, p.replicas, p.isrs)
    admin.create_missing({name: TopicSpec(name, 3, 1, {"cleanup.policy": "compact"})})
    assert admin.state([name])[name].replication_factor == 3
    admin.delete([name])
