"""Topic definitions: expansion, validation errors that say where, and the reconcile plan."""

import re
from pathlib import Path

import pytest

from streams.errors import ConfigError
from streams.topology.spec import TopicSpec, TopicState, load_definitions, parse_definitions, plan

REPO_TOPICS = Path(__file__).resolve().parents[2] / "topics"


def test_repository_definitions_cover_every_lane_tier_and_system_topic():
    specs = load_definitions(REPO_TOPICS)
    for channel in ("email", "sms", "webhook"):
        for lane in ("transactional", "marketing"):
            assert f"notif.{channel}.{lane}" in specs
            for tier in ("10s", "1m", "5m", "15m", "1h", "3h", "6h", "12h"):
                retry = specs[f"notif.{channel}.{lane}.retry.{tier}"]
                assert retry.partitions >= specs[f"notif.{channel}.{lane}"].partitions
    assert specs["notif.lag"].config["cleanup.policy"] == "compact"
    assert specs["notif.email.marketing"].config["retention.ms"] == str(7 * 24 * 3600 * 1000)
    assert specs["notif.outcomes"].config["retention.ms"] == str(30 * 24 * 3600 * 1000)
    assert specs["notif.operator"].config["cleanup.policy"] == "compact" and specs["notif.operator"].partitions == 1
    assert specs["notif.endpoint.state"].config["cleanup.policy"] == "compact"
    assert specs["notif.webhook.skipped"].config["retention.ms"] == str(7 * 24 * 3600 * 1000)  # the replay window
    assert len(specs) == 3 * 2 * (1 + 8) + 8


def test_namespace_prefixes_every_name():
    specs = parse_definitions(Path("x.toml"), '[[topic]]\nname="notif.{channel}.{lane}"\n'
                              'partitions=2\nreplication_factor=1\n', namespace="ns.")
    assert {s.name for s in specs} == {f"ns.notif.{c}.{lane}" for c in ("email", "sms", "webhook")
                                       for lane in ("transactional", "marketing")}


@pytest.mark.parametrize("body, expected", [
    ('name="a"\npartitions=0\nreplication_factor=1', "x.toml: topic 'a': field 'partitions' must be an integer >= 1, got 0"),
    ('name="a"\npartitions=1', "x.toml: topic 'a': field 'replication_factor' must be an integer >= 1, got None"),
    ('name="a"\npartitions=1\nreplication_factor=1\nconfig={"retention.msx"="1"}', "x.toml: topic 'a': field 'config.retention.msx' is not a known topic config"),
    ('name="a"\npartitions=1\nreplication_factor=1\nconfig={"retention.ms"="7d"}', "x.toml: topic 'a': field 'config.retention.ms' must be an integer from -1 to 9223372036854775807, got '7d'"),
    ('name="a"\npartitions=1\nreplication_factor=1\nconfig={"cleanup.policy"="compacted"}', "field 'config.cleanup.policy' must be one of"),
    ('name="notif.{region}"\npartitions=1\nreplication_factor=1', "x.toml: topic 'notif.{region}': field 'name': unknown placeholder {region}"),
    ('name="a"\npartitions=1\nreplication_factor=1\npartition=3', "x.toml: topic 'a': unknown field(s) ['partition']"),
    ('partitions=1\nreplication_factor=1', "x.toml: [[topic]] #1: field 'name' is required"),
    ('name="a b"\npartitions=1\nreplication_factor=1', "invalid Kafka topic name 'a b'"),
    # Python's `$` matched before a final newline, and `\d` any Unicode digit: neither reaches the broker.
    ('name="a\\n"\npartitions=1\nreplication_factor=1', "invalid Kafka topic name 'a\\n'"),
    ('name="a"\npartitions=1\nreplication_factor=1\nconfig={"retention.ms"="\u0661\u0662"}',
     "field 'config.retention.ms' must be an integer"),
    # Values the broker would refuse, once other topics of the plan were created already (before: accepted).
    ('name="a"\npartitions=1\nreplication_factor=1\nconfig={"max.message.bytes"="lots"}',
     "field 'config.max.message.bytes' must be an integer from 0 to 2147483647, got 'lots'"),
    ('name="a"\npartitions=1\nreplication_factor=1\nconfig={"retention.ms"=-7}',
     "field 'config.retention.ms' must be an integer from -1 to 9223372036854775807, got '-7'"),
    ('name="a"\npartitions=1\nreplication_factor=1\nconfig={"min.insync.replicas"=0}',
     "field 'config.min.insync.replicas' must be an integer from 1 to 2147483647, got '0'"),
    # Kafka 4's least segment (1 MiB), and an INT config past what the broker reads as one.
    ('name="a"\npartitions=1\nreplication_factor=1\nconfig={"segment.bytes"=1000}',
     "field 'config.segment.bytes' must be an integer from 1048576 to 2147483647, got '1000'"),
    ('name="a"\npartitions=1\nreplication_factor=1\nconfig={"max.message.bytes"=3000000000}',
     "field 'config.max.message.bytes' must be an integer from 0 to 2147483647, got '3000000000'"),
    ('name="a"\npartitions=1\nreplication_factor=1\nconfig={"compression.type"="brotli"}',
     "field 'config.compression.type' must be one of"),
    ('name="a"\npartitions=1\nreplication_factor=1\nconfig={"min.cleanable.dirty.ratio"="1.5"}',
     "field 'config.min.cleanable.dirty.ratio' must be a number from 0 to 1, got '1.5'"),
    # Retention that deletes at once (0 is read as "forever" by some), and topics read from partition 0 alone.
    ('name="a"\npartitions=1\nreplication_factor=1\nconfig={"retention.ms"=0}',
     "field 'config.retention.ms' must be -1 (no limit) or at least 3600000, got 0"),
    ('name="a"\npartitions=1\nreplication_factor=1\nconfig={"retention.bytes"=1000}',
     "field 'config.retention.bytes' must be -1 (no limit) or at least 1048576, got 1000"),
    ('name="notif.operator"\npartitions=3\nreplication_factor=1',
     "x.toml: topic 'notif.operator': field 'partitions' must be 1, got 3: notif.operator is read from its partition 0"),
    ('name="notif.lag"\npartitions=2\nreplication_factor=1', "field 'partitions' must be 1, got 2"),
])
def test_invalid_definition_names_file_topic_and_field(body, expected):
    with pytest.raises(ConfigError) as err:
        parse_definitions(Path("x.toml"), "[[topic]]\n" + body + "\n")
    assert expected in str(err.value)


def test_retry_topic_with_fewer_partitions_than_its_lane_is_rejected(tmp_path):
    (tmp_path / "a.toml").write_text('[[topic]]\nname="notif.email.marketing"\npartitions=6\nreplication_factor=1\n'
                                     '[[topic]]\nname="notif.email.marketing.retry.10s"\npartitions=2\nreplication_factor=1\n')
    with pytest.raises(ConfigError, match=r"notif.email.marketing.retry.10s has 2 partitions, fewer than its lane"):
        load_definitions(tmp_path)


def test_a_dlq_with_fewer_partitions_than_a_lane_is_rejected(tmp_path):
    """Given lanes raised to 12 partitions and notif.dlq left at 6,
    When the definitions are loaded,
    Then they are refused naming the DLQ and the lane (before, only retry topics were compared with their lane)."""
    (tmp_path / "a.toml").write_text('[[topic]]\nname="notif.sms.transactional"\npartitions=6\nreplication_factor=1\n'
                                     '[[topic]]\nname="notif.email.marketing"\npartitions=12\nreplication_factor=1\n'
                                     '[[topic]]\nname="notif.dlq"\npartitions=6\nreplication_factor=1\n')
    with pytest.raises(ConfigError, match=r"notif.dlq has 6 partitions, fewer than its lane notif.email.marketing"):
        load_definitions(tmp_path)
    (tmp_path / "a.toml").write_text(
        (tmp_path / "a.toml").read_text().replace('"notif.dlq"\npartitions=6', '"notif.dlq"\npartitions=12'))
    assert load_definitions(tmp_path)["notif.dlq"].partitions == 12


def test_min_insync_replicas_above_the_replication_factor_is_refused_as_written_and_kept_for_a_profile(tmp_path):
    """Given a topic of 1 replica whose definition asks 2 in sync (every acks=all write would be refused, for good:
    the lanes stall behind NOT_ENOUGH_REPLICAS),
    When the definitions are loaded as written, and with the cluster profile (3 replicas),
    Then as written they are refused naming the file, topic and field; with the profile they load, keeping 2."""
    (tmp_path / "a.toml").write_text('[[topic]]\nname="notif.dlq"\npartitions=1\nreplication_factor=1\n'
                                     'config={"min.insync.replicas"=2}\n')
    with pytest.raises(ConfigError, match=r"topic 'notif.dlq': field 'config.min.insync.replicas' = 2 is more than"):
        load_definitions(tmp_path)
    assert load_definitions(tmp_path, profile="cluster")["notif.dlq"].config["min.insync.replicas"] == "2"


def test_topic_defined_twice_is_rejected(tmp_path):
    (tmp_path / "a.toml").write_text('[[topic]]\nname="notif.dlq"\npartitions=1\nreplication_factor=1\n')
    (tmp_path / "b.toml").write_text('[[topic]]\nname="notif.dlq"\npartitions=1\nreplication_factor=1\n')
    with pytest.raises(ConfigError, match="already defined"):
        load_definitions(tmp_path)


def test_plan_creates_grows_reconciles_and_refuses_shrinking():
    desired = {
        "new": TopicSpec("new", 3, 1, {"retention.ms": "10"}),
        "grow": TopicSpec("grow", 6, 1, {}),
        "shrink": TopicSpec("shrink", 2, 1, {}),
        "cfg": TopicSpec("cfg", 1, 1, {"retention.ms": "20"}),
        "same": TopicSpec("same", 1, 1, {"cleanup.policy": "compact"}),
    }
    actual = {
        "grow": TopicState(3, 1, {}),
        "shrink": TopicState(6, 1, {}),
        "cfg": TopicState(1, 1, {"retention.ms": "10", "segment.ms": "5"}),
        "same": TopicState(1, 1, {"cleanup.policy": "compact"}),
    }
    kinds = {(c.topic, c.kind, c.key) for c in plan(desired, actual)}
    assert kinds == {
        ("new", "create", ""), ("grow", "add_partitions", ""), ("shrink", "refused", ""),
        ("cfg", "set_config", "retention.ms"), ("cfg", "delete_config", "segment.ms"),
    }
    refused = next(c for c in plan(desired, actual) if c.kind == "refused")
    assert "cannot remove partitions" in refused.detail


def test_growing_the_webhook_attempts_topic_alone_is_refused_naming_endpoint_health():
    """Given the definitions raising notif.webhook.attempts from 6 to 12 partitions (and a lane from 6 to 12),
    When the change is planned (`streams topics plan` / `apply`),
    Then the attempts topic's growth is refused, naming the endpoint-health changelog built on its count and where
    to read how to grow both (before: applied, and every endpoint-health copy stopped at its next start, no
    endpoint degraded or alerted on); the lane still grows."""
    desired = {"t.notif.webhook.attempts": TopicSpec("t.notif.webhook.attempts", 12, 1, {}),
               "t.notif.email.marketing": TopicSpec("t.notif.email.marketing", 12, 1, {})}
    actual = {name: TopicState(6, 1, {}) for name in desired}
    changes = plan(desired, actual)
    assert {(c.topic, c.kind) for c in changes} == {("t.notif.webhook.attempts", "refused"),
                                                    ("t.notif.email.marketing", "add_partitions")}
    [refused] = [c for c in changes if c.kind == "refused"]
    assert "partitions 6 -> 12" in refused.detail and "changelog" in refused.detail
    assert "EndpointHealthBehind" in refused.detail


def test_a_roles_own_topic_gets_its_configs_also_when_its_replicas_were_raised_by_an_earlier_try():
    """Given the endpoint-health changelog with 3 replicas already (an earlier start raised them, then failed
    before setting its configs) and no min.insync.replicas,
    When the role starts again (`create_missing` with the cluster profile's spec),
    Then the configs are set, without another reassignment (before: only a call that raised the replicas set them,
    so the changelog kept min.insync.replicas 1 for good)."""
    from streams.topology.admin import TopicAdmin

    admin = TopicAdmin.__new__(TopicAdmin)  # no cluster: its reads and writes are recorded
    spec = TopicSpec("ns.endpoint-health-changelog", 6, 3, {"cleanup.policy": "compact", "min.insync.replicas": "2"})
    applied: list = []
    admin.state = lambda names: {spec.name: TopicState(6, 3, {"cleanup.policy": "compact"})}  # type: ignore[method-assign]
    admin.apply = lambda changes, specs: applied.extend(changes)  # type: ignore[method-assign]
    admin._wait_visible = admin._wait_brokers_agree = lambda *args, **kwargs: None  # type: ignore[method-assign]
    admin.create_missing({spec.name: spec})
    assert [(c.kind, c.key, c.value) for c in applied] == [("set_config", "min.insync.replicas", "2")]


def test_a_roles_own_topic_of_more_replicas_than_its_spec_is_left_as_it_is():
    """Given the changelog with 3 replicas and min.insync.replicas 2,
    When a copy started without the cluster profile (its spec: 1 replica, min.insync.replicas 1) starts,
    Then nothing is changed (not min.insync.replicas lowered to 1: writes acknowledged by one replica only)."""
    from streams.topology.admin import TopicAdmin

    admin = TopicAdmin.__new__(TopicAdmin)
    spec = TopicSpec("ns.endpoint-health-changelog", 6, 1, {"cleanup.policy": "compact", "min.insync.replicas": "1"})
    applied: list = []
    admin.state = lambda names: {spec.name: TopicState(6, 3, {"cleanup.policy": "compact",  # type: ignore[method-assign]
                                                              "min.insync.replicas": "2"})}
    admin.apply = lambda changes, specs: applied.extend(changes)  # type: ignore[method-assign]
    admin._wait_visible = admin._wait_brokers_agree = lambda *args, **kwargs: None  # type: ignore[method-assign]
    admin.create_missing({spec.name: spec})
    assert applied == []


def test_a_roles_own_topic_made_with_another_cleanup_policy_stops_the_role_naming_it():
    """Given the endpoint-health changelog made by hand with cleanup.policy=delete (its state would age out),
    When the role starts (`create_missing` with its compacted spec),
    Then it stops with TopicPlanError naming the topic and the policy, changing nothing (before: the refusal was
    dropped and the role ran on a log that deletes its state after the retention)."""
    from streams.topology.admin import TopicAdmin, TopicPlanError

    admin = TopicAdmin.__new__(TopicAdmin)
    spec = TopicSpec("ns.endpoint-health-changelog", 6, 1, {"cleanup.policy": "compact"})
    applied: list = []
    admin.state = lambda names: {spec.name: TopicState(6, 1, {"cleanup.policy": "delete"})}  # type: ignore[method-assign]
    admin.apply = lambda changes, specs: applied.extend(changes)  # type: ignore[method-assign]
    with pytest.raises(TopicPlanError, match="ns.endpoint-health-changelog: cleanup.policy delete -> compact"):
        admin.create_missing({spec.name: spec})
    assert applied == []


@pytest.mark.parametrize("have, want", [("delete", "compact"), ("compact", "delete"), ("compact", None)])
def test_a_cleanup_policy_change_of_a_live_topic_is_refused_and_the_rest_of_its_configs_planned(have, want):
    """Given a lane topic the definitions would turn compacted (one send a tenant kept), a compacted state log they
    would turn to deletion (its state aged out), or one whose policy they would drop,
    When the plan is made,
    Then the policy change is refused, saying why, and the topic's other configs are planned as ever (before: an
    ordinary set_config, which `apply` made)."""
    desired = {"t": TopicSpec("t", 1, 1, {"retention.ms": "7200000", **({"cleanup.policy": want} if want else {})})}
    actual = {"t": TopicState(1, 1, {"cleanup.policy": have, "retention.ms": "3600000"})}
    changes = plan(desired, actual)
    assert [(c.kind, c.key) for c in changes] == [("refused", ""), ("set_config", "retention.ms")]
    assert f"cleanup.policy {have} -> {want or '(default)'}: compaction keeps one record per key" in changes[0].detail


def test_a_topic_without_a_cleanup_policy_override_matches_a_definition_saying_delete():
    """Given a topic made without config overrides (by hand, by other tooling: the broker's default, delete),
    When its definition says `cleanup.policy = "delete"`,
    Then the plan sets it as any config, and refuses nothing (the policy does not change)."""
    changes = plan({"t": TopicSpec("t", 1, 1, {"cleanup.policy": "delete"})}, {"t": TopicState(1, 1, {})})
    assert [(c.kind, c.key) for c in changes] == [("set_config", "cleanup.policy")]


def test_topics_apply_refuses_a_retry_tier_that_would_delete_parked_copies(tmp_path, capsys, monkeypatch):
    """Given the definitions with the retry tiers' retention lowered to a day (the policies keep copies up to their
    max age, 2 days for marketing, and a day's room past it),
    When an operator plans or applies them,
    Then the command refuses before asking the broker anything, naming the policy and the tier (before: the
    retention was set, parked copies were deleted unreleased, their sends `retrying` for good, and only the roles
    started later refused to run)."""
    from streams.cli import main

    for source in REPO_TOPICS.glob("*.toml"):
        (tmp_path / source.name).write_text(source.read_text())
    retry = tmp_path / "retry.toml"
    retry.write_text(retry.read_text().replace('"retention.ms" = 604800000', '"retention.ms" = 86400000'))
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9")  # never reached
    for action in ("plan", "apply"):
        assert main(["topics", action, "--dir", str(tmp_path), "--namespace", ""]) == 1
        assert re.search(r"retry policy '\w+'.* leaves less than a day of notif\.email\.transactional\.retry\.10s's "
                         r"retention \(24 h\)", capsys.readouterr().err)


def test_a_topic_described_with_an_error_is_named_not_planned_as_missing(monkeypatch):
    """Given a lane topic the broker describes with TOPIC_AUTHORIZATION_FAILED (an ACL denying Describe), and
    another it does not know (UNKNOWN_TOPIC_OR_PART),
    When the cluster's state is read for a plan,
    Then the first is named with its error once the read has been asked again for its time (before: taken as
    missing, planned `create`, and the apply failed with "already exists"); the second alone is missing."""
    from types import SimpleNamespace

    from confluent_kafka import KafkaError

    from streams.errors import StackError
    from streams.topology import admin as admin_module
    from streams.topology.admin import TopicAdmin

    errors = {"notif.email.transactional": KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED),
              "notif.sms.transactional": KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART)}
    admin = TopicAdmin.__new__(TopicAdmin)
    admin.bootstrap = "unused:9092"
    admin.admin = SimpleNamespace(list_topics=lambda timeout: SimpleNamespace(topics={
        name: SimpleNamespace(error=error, partitions={}) for name, error in errors.items()}))
    monkeypatch.setattr(admin_module, "TIMEOUT_S", 0.3)
    with pytest.raises(StackError, match=r"cannot describe topic\(s\) notif.email.transactional \(.*[Aa]uthoriz"):
        admin.state(list(errors))
    assert admin.state(["notif.sms.transactional"]) == {}
