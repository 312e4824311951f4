"""`streams topics plan|apply` against a real broker, in a namespace of its own."""

import shutil
from pathlib import Path

import pytest

from streams.cli import main
from streams.topology.admin import TopicAdmin
from streams.topology.spec import load_definitions

REPO_TOPICS = Path(__file__).resolve().parents[2] / "topics"


@pytest.fixture
def topics_cli(stack, namespace, monkeypatch, capsys):
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", stack.bootstrap)
    created = []

    def run(action: str, directory: Path) -> tuple[int, str, str]:
        """The exit code, stdout (the command's report) and stderr (its errors, and any log line)."""
        code = main(["topics", action, "--dir", str(directory), "--namespace", namespace])
        out = capsys.readouterr()
        created.extend(load_definitions(directory, namespace))
        return code, out.out, out.err

    yield run
    TopicAdmin(stack.bootstrap).delete(sorted(set(created)))


def test_apply_creates_every_topic_then_plan_is_clean_and_apply_is_idempotent(topics_cli, stack, namespace):
    """Given the repository's topic definitions and an empty namespace on a real broker,
    When `streams topics plan` and `apply` are run, and both are run again,
    Then the first plan exits 2 with 62 changes pending, apply succeeds, the second plan and apply report 62 topics
    defined and 0 changes, notif.lag is compacted and the marketing email lane has 6 partitions."""
    code, out, _ = topics_cli("plan", REPO_TOPICS)
    assert code == 2 and "62 change(s) pending" in out

    code, out, err = topics_cli("apply", REPO_TOPICS)
    assert code == 0, out + err

    assert topics_cli("plan", REPO_TOPICS)[:2] == (0, "62 topics defined, 0 change(s) pending\n")
    assert topics_cli("apply", REPO_TOPICS)[:2] == (0, "62 topics defined, 0 change(s) applied\n")

    state = TopicAdmin(stack.bootstrap).state([f"{namespace}notif.lag", f"{namespace}notif.email.marketing"])
    assert state[f"{namespace}notif.lag"].overrides["cleanup.policy"] == "compact"
    assert state[f"{namespace}notif.email.marketing"].partitions == 6


def test_changed_retention_is_planned_named_and_applied(topics_cli, tmp_path, namespace):
    """Given the system topics applied, and the retention of notif.outcomes changed in its definition from 30 days to 1
    day,
    When `streams topics plan` is run,
    Then it exits 2 naming the topic, the retention.ms key and both values, and `apply` makes the plan clean again."""
    shutil.copy(REPO_TOPICS / "system.toml", tmp_path / "system.toml")
    assert topics_cli("apply", tmp_path)[0] == 0

    # Given the outcomes topic's retention is changed in its definition
    text = (tmp_path / "system.toml").read_text()
    (tmp_path / "system.toml").write_text(text.replace(
        '"retention.ms" = 2592000000  # 30 days\n\n[[topic]]\nname = "notif.lag"',
        '"retention.ms" = 86400000\n\n[[topic]]\nname = "notif.lag"'))

    # When planning, then exit 2 names the topic, the key and both values
    code, out, _ = topics_cli("plan", tmp_path)
    assert code == 2
    assert f"set_config      {namespace}notif.outcomes: retention.ms: 2592000000 -> 86400000" in out

    # And apply makes the plan clean again
    assert topics_cli("apply", tmp_path)[0] == 0
    assert topics_cli("plan", tmp_path)[0] == 0


def test_fewer_partitions_is_refused_with_the_reason(topics_cli, tmp_path, namespace):
    """Given notif.dlq applied with 4 partitions,
    When its definition is lowered to 2 partitions and applied,
    Then apply exits 1 saying Kafka cannot remove partitions and that nothing was applied, while raising it to 8
    partitions applies and leaves a clean plan."""
    (tmp_path / "t.toml").write_text('[[topic]]\nname="notif.dlq"\npartitions=4\nreplication_factor=1\n')
    assert topics_cli("apply", tmp_path)[0] == 0
    (tmp_path / "t.toml").write_text('[[topic]]\nname="notif.dlq"\npartitions=2\nreplication_factor=1\n')

    code, out, err = topics_cli("apply", tmp_path)
    out += err
    assert code == 1
    assert f"{namespace}notif.dlq: partitions 4 -> 2: Kafka cannot remove partitions" in out
    assert "nothing applied" in out

    (tmp_path / "t.toml").write_text('[[topic]]\nname="notif.dlq"\npartitions=8\nreplication_factor=1\n')
    assert topics_cli("apply", tmp_path)[0] == 0
    assert topics_cli("plan", tmp_path)[0] == 0


def test_bad_definition_is_rejected_before_touching_the_cluster(stack, tmp_path, monkeypatch, capsys):
    """Given a topic definition file in which partitions is "six",
    When `streams topics apply` is run on it,
    Then it exits 1 with an error naming the file, the topic, the field and the bad value, and no topic is created on
    the broker."""
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", stack.bootstrap)
    (tmp_path / "bad.toml").write_text('[[topic]]\nname="notif.dlq"\npartitions="six"\nreplication_factor=1\n')

    code = main(["topics", "apply", "--dir", str(tmp_path), "--namespace", "never-created."])

    assert code == 1
    assert (f"error: {tmp_path / 'bad.toml'}: topic 'notif.dlq': field 'partitions' must be an "
            "integer >= 1, got 'six'") in capsys.readouterr().err
    assert TopicAdmin(stack.bootstrap).state(["never-created.notif.dlq"]) == {}
