"""`streams topics plan|apply` against a real broker, in a namespace of its own."""

import shutil
from pathlib import Path

import pytest

from streams.cli import main
from streams.topic_admin import TopicAdmin
from streams.topic_spec import load_definitions

REPO_TOPICS = Path(__file__).resolve().parents[2] / "topics"


@pytest.fixture
def topics_cli(stack, namespace, monkeypatch, capsys):
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", stack.bootstrap)
    created = []

    def run(action: str, directory: Path) -> tuple[int, str]:
        code = main(["topics", action, "--dir", str(directory), "--namespace", namespace])
        out = capsys.readouterr()
        created.extend(load_definitions(directory, namespace))
        return code, out.out + out.err

    yield run
    TopicAdmin(stack.bootstrap).delete(sorted(set(created)))


def test_apply_creates_every_topic_then_plan_is_clean_and_apply_is_idempotent(topics_cli, stack, namespace):
    code, out = topics_cli("plan", REPO_TOPICS)
    assert code == 2 and "57 change(s) pending" in out

    code, out = topics_cli("apply", REPO_TOPICS)
    assert code == 0, out

    assert topics_cli("plan", REPO_TOPICS) == (0, "57 topics defined, 0 change(s) pending\n")
    assert topics_cli("apply", REPO_TOPICS) == (0, "57 topics defined, 0 change(s) applied\n")

    state = TopicAdmin(stack.bootstrap).state([f"{namespace}notif.lag", f"{namespace}notif.email.marketing"])
    assert state[f"{namespace}notif.lag"].overrides["cleanup.policy"] == "compact"
    assert state[f"{namespace}notif.email.marketing"].partitions == 6


def test_changed_retention_is_planned_named_and_applied(topics_cli, tmp_path, namespace):
    shutil.copy(REPO_TOPICS / "system.toml", tmp_path / "system.toml")
    assert topics_cli("apply", tmp_path)[0] == 0

    # Given the outcomes topic's retention is changed in its definition
    text = (tmp_path / "system.toml").read_text()
    (tmp_path / "system.toml").write_text(text.replace(
        '"retention.ms" = 2592000000  # 30 days\n\n[[topic]]\nname = "notif.lag"',
        '"retention.ms" = 86400000\n\n[[topic]]\nname = "notif.lag"'))

    # When planning, then exit 2 names the topic, the key and both values
    code, out = topics_cli("plan", tmp_path)
    assert code == 2
    assert f"set_config      {namespace}notif.outcomes: retention.ms: 2592000000 -> 86400000" in out

    # And apply makes the plan clean again
    assert topics_cli("apply", tmp_path)[0] == 0
    assert topics_cli("plan", tmp_path)[0] == 0


def test_fewer_partitions_is_refused_with_the_reason(topics_cli, tmp_path, namespace):
    (tmp_path / "t.toml").write_text('[[topic]]\nname="notif.dlq"\npartitions=4\nreplication_factor=1\n')
    assert topics_cli("apply", tmp_path)[0] == 0
    (tmp_path / "t.toml").write_text('[[topic]]\nname="notif.dlq"\npartitions=2\nreplication_factor=1\n')

    code, out = topics_cli("apply", tmp_path)
    assert code == 1
    assert f"{namespace}notif.dlq: partitions 4 -> 2: Kafka cannot remove partitions" in out
    assert "nothing applied" in out

    (tmp_path / "t.toml").write_text('[[topic]]\nname="notif.dlq"\npartitions=8\nreplication_factor=1\n')
    assert topics_cli("apply", tmp_path)[0] == 0
    assert topics_cli("plan", tmp_path)[0] == 0


def test_bad_definition_is_rejected_before_touching_the_cluster(stack, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", stack.bootstrap)
    (tmp_path / "bad.toml").write_text('[[topic]]\nname="notif.dlq"\npartitions="six"\nreplication_factor=1\n')

    code = main(["topics", "apply", "--dir", str(tmp_path), "--namespace", "never-created."])

    assert code == 1
    assert (f"error: {tmp_path / 'bad.toml'}: topic 'notif.dlq': field 'partitions' must be an "
            "integer >= 1, got 'six'") in capsys.readouterr().err
    assert TopicAdmin(stack.bootstrap).state(["never-created.notif.dlq"]) == {}
