"""A supervised fleet (`streams fleet up`, the demo, the benchmarks) restarts a role that exits, with
backoff, and says so, as a process supervisor would in a deployment."""

from streams.devtools.fleet import Fleet
from tests.harness import wait_until


def test_a_supervised_fleet_restarts_a_role_that_exits(tmp_path, capfd):
    """Given a supervised fleet running a role that exits right after it starts,
    When it exits,
    Then the fleet starts it again (twice within ~5 s: backoff 1 s, then 2 s) and reports each restart."""
    with Fleet("sup.", tmp_path / "logs", supervise=True) as fleet:
        fleet.start("short-lived", "dev", "status")  # prints the stack's state and exits
        member = fleet.members[0]
        wait_until(lambda: member.restarts >= 2, 15, "two restarts")
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
