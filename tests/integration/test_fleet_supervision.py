"""A supervised fleet (`streams fleet up`, the demo, the benchmarks) restarts a role that exits, with
backoff, and says so, as a process supervisor would in a deployment; a benchmark's fleet leaves
nothing behind."""

from streams.devtools.fleet import Fleet
from streams.topology.admin import TopicAdmin
from tests.harness import wait_until


def test_a_supervised_fleet_restarts_a_role_that_exits(tmp_path, capfd):
    """Given a supervised fleet running a role that exits right after it starts,
    When it exits,
    Then the fleet starts it again (twice within ~5 s: backoff 1 s, then 2 s) and reports each restart."""
    with Fleet("sup.", tmp_path / "logs", supervise=True) as fleet:
        fleet.start("short-lived", "dev", "status")  # prints the stack's state and exits
        member = fleet.members[0]
        wait_until(lambda: member.restarts >= 2, 60, "two restarts")  # ~5 s, each start a Python process's
    err = capfd.readouterr().err
    assert "fleet: short-lived exited" in err and "restarted short-lived (restart #2)" in err


def test_an_unsupervised_fleet_leaves_a_dead_role_alone(tmp_path):
    """Given an unsupervised fleet (the tests' own),
    When a role exits,
    Then nothing restarts it: tests decide what runs."""
    with Fleet("nosup.", tmp_path / "logs") as fleet:
        proc = fleet.start("short-lived", "dev", "status")
        proc.wait(30)
        assert fleet.members[0].restarts == 0 and fleet.members[0].proc is proc


def test_a_benchmark_fleet_leaves_no_topics_or_redis_keys_behind(stack, redis_client, namespace, tmp_path):
    """Given a fleet started as the benchmarks start theirs (`forget=True`), with its topics created and keys written,
    When it exits,
    Then none of its namespace's topics or Redis keys are left (a broker or a Redis grown by earlier runs would
    stretch the next benchmark's tail), and nothing of another namespace is touched."""
    admin = TopicAdmin(stack.bootstrap)
    neighbour = f"{namespace[:-1]}-other."  # a namespace ends with its dot: this one is not inside it
    try:
        with Fleet(neighbour, tmp_path / "other") as other:
            other.create_topics()
        redis_client.set(f"{neighbour}some-key", "1")
        with Fleet(namespace, tmp_path / "logs", forget=True) as fleet:
            fleet.create_topics()
            redis_client.set(f"{namespace}some-key", "1")
            assert len(admin.named(namespace)) == len(admin.named(neighbour)) > 0
        assert list(redis_client.scan_iter(match=f"{namespace}*")) == []
        wait_until(lambda: admin.named(namespace) == [], 30, "the deleted topics to leave the cluster's metadata")
        assert len(admin.named(neighbour)) > 0 and redis_client.get(f"{neighbour}some-key") == b"1"
    finally:
        admin.delete(admin.named(neighbour))
        redis_client.delete(f"{neighbour}some-key")
