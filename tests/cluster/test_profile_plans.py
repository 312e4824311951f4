"""Replication profiles and replica placement as pure code: no broker (they live beside the cluster
tests they belong with)."""

from pathlib import Path

import pytest

from streams.errors import ConfigError
from streams.topology.admin import place_replicas
from streams.topology.spec import (
    PROFILES,
    REPO_TOPICS,
    TopicSpec,
    TopicState,
    load_definitions,
    parse_definitions,
    plan,
    topic_profile,
)

pytestmark = pytest.mark.cluster


def test_without_a_profile_definitions_are_taken_as_written():
    """Given the repository's topic definitions,
    When they are loaded without a profile, and with each profile,
    Then without one every topic keeps its written replication factor (1) and sets no min.insync.replicas, exactly as
    the same files parsed one by one; the dev profile gives 1 replica and min.insync.replicas=1, the cluster profile 3
    and 2; names, partitions and every other config are the same in all three."""
    written = load_definitions(REPO_TOPICS)
    parsed = {s.name: s for path in sorted(REPO_TOPICS.glob("*.toml"))
              for s in parse_definitions(path, path.read_text())}
    assert written == parsed
    assert {s.replication_factor for s in written.values()} == {1}
    assert not any("min.insync.replicas" in s.config for s in written.values())
    for name, (rf, isr) in {"dev": (1, "1"), "cluster": (3, "2")}.items():
        profiled = load_definitions(REPO_TOPICS, profile=name)
        assert profiled == load_definitions(REPO_TOPICS, profile=PROFILES[name])
        assert set(profiled) == set(written)
        for topic, spec in profiled.items():
            assert (spec.replication_factor, spec.config["min.insync.replicas"]) == (rf, isr)
            assert spec.partitions == written[topic].partitions
            assert {k: v for k, v in spec.config.items() if k != "min.insync.replicas"} == written[topic].config


def test_unknown_profile_and_unmeetable_min_insync_replicas_are_refused(tmp_path: Path):
    """Given a topic whose definition sets min.insync.replicas = 3 itself,
    When it is loaded with the cluster profile, the dev profile, and a profile called "prod",
    Then the cluster profile keeps its 3 (3 replicas can meet it), the dev profile is refused naming the file, the
    topic, the field and the profile, and "prod" is refused naming the known profiles."""
    (tmp_path / "t.toml").write_text('[[topic]]\nname="notif.dlq"\npartitions=1\nreplication_factor=1\n'
                                     '[topic.config]\n"min.insync.replicas" = 3\n')
    assert load_definitions(tmp_path, profile="cluster")["notif.dlq"].config["min.insync.replicas"] == "3"
    with pytest.raises(ConfigError, match=r"t.toml: topic 'notif.dlq': field 'config.min.insync.replicas' = 3 "
                                          r"cannot be met with the 'dev' profile's 1 replica"):
        load_definitions(tmp_path, profile="dev")
    with pytest.raises(ConfigError, match=r"unknown topic profile 'prod' \(known: dev, cluster\)"):
        topic_profile("prod")


def test_plan_raises_a_replication_factor_and_refuses_to_lower_one():
    """Given topics with 1 replica desired at 3, with 3 desired at 1, and with 3 desired at 3,
    When the plan is made,
    Then the first is an `add_replicas` change to 3 (a reassignment), the second is refused saying that lowering
    throws copies away, and the third needs nothing."""
    desired = {"up": TopicSpec("up", 2, 3), "down": TopicSpec("down", 2, 1), "same": TopicSpec("same", 2, 3)}
    actual = {"up": TopicState(2, 1, {}), "down": TopicState(2, 3, {}), "same": TopicState(2, 3, {})}

    changes = {c.topic: c for c in plan(desired, actual)}

    assert set(changes) == {"up", "down"}
    assert (changes["up"].kind, changes["up"].replication_factor) == ("add_replicas", 3)
    assert str(changes["up"]).startswith("add_replicas    up: replication factor 1 -> 3 (partition reassignment")
    assert changes["down"].kind == "refused"
    assert "replication factor 3 -> 1: lowering it throws away copies of every partition" in changes["down"].detail


def test_new_replicas_keep_the_leader_and_spread_evenly():
    """Given six partitions with one replica each, two on each of brokers 1, 2 and 3, and a seventh with three already,
    When they are placed for 3 replicas,
    Then each of the six keeps its replica first (the leader stays), gets two other brokers, every broker ends with
    six replicas, and the seventh is left alone."""
    current = {0: [1], 1: [2], 2: [3], 3: [1], 4: [3], 5: [2], 6: [3, 1, 2]}

    moves = place_replicas(current, 3, [1, 2, 3])

    assert set(moves) == {0, 1, 2, 3, 4, 5}
    for p, replicas in moves.items():
        assert replicas[0] == current[p][0] and sorted(replicas) == [1, 2, 3]
    load = [b for replicas in moves.values() for b in replicas]
    assert {b: load.count(b) for b in (1, 2, 3)} == {1: 6, 2: 6, 3: 6}


def test_placement_on_more_brokers_than_replicas_balances_the_new_copies():
    """Given twelve single-replica partitions spread over brokers 1 to 4,
    When they are placed for 3 replicas on 4 brokers,
    Then each partition gets 3 distinct brokers, its own first, and the brokers' shares of the 36 replicas differ by
    at most one."""
    current = {p: [p % 4 + 1] for p in range(12)}

    moves = place_replicas(current, 3, [1, 2, 3, 4])

    assert all(r[0] == current[p][0] and len(set(r)) == 3 for p, r in moves.items())
    load = [b for replicas in moves.values() for b in replicas]
    shares = [load.count(b) for b in (1, 2, 3, 4)]
    assert sum(shares) == 36 and max(shares) - min(shares) <= 1, shares
