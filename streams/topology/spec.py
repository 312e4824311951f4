"""Declarative topic definitions (`topics/*.toml`) and the plan that reconciles a cluster. Pure code.

A definition file holds `[[topic]]` tables. A name may use the placeholders `{channel}`, `{lane}`
and `{tier}`, which expand over the channels, lanes and retry tiers of `streams.lanes`.

A replication profile (`PROFILES`: `dev` 1 copy, `cluster` 3 copies with 2 in sync) sets every
topic's replication factor and `min.insync.replicas`; without one, the definitions are taken as
written (their `replication_factor`, the single-broker value). docs/cluster.md tells how to choose.
"""

from __future__ import annotations

import itertools
import re
import string
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from ..lanes import CHANNELS, LANES, RETRY_TIERS

# The repository's topic definitions (`topics/*.toml`); from an installed package, `./topics`.
REPO_TOPICS = Path(__file__).resolve().parents[2] / "topics"

PLACEHOLDERS: dict[str, tuple[str, ...]] = {
    "channel": CHANNELS, "lane": LANES, "tier": tuple(RETRY_TIERS),
}
# Topic configs a definition may set; anything else is most likely a typo.
KNOWN_CONFIGS = frozenset({
    "cleanup.policy", "retention.ms", "retention.bytes", "segment.ms", "segment.bytes",
    "min.insync.replicas", "max.message.bytes", "min.compaction.lag.ms", "max.compaction.lag.ms",
    "delete.retention.ms", "compression.type", "message.timestamp.type", "min.cleanable.dirty.ratio",
})
# The integer configs and the least value the broker takes for each (-1: no limit).
_INTEGER_AT_LEAST = {"retention.ms": -1, "retention.bytes": -1, "segment.ms": 1, "segment.bytes": 1024 * 1024,
                     "min.insync.replicas": 1, "max.message.bytes": 0, "min.compaction.lag.ms": 0,
                     "max.compaction.lag.ms": 1, "delete.retention.ms": 0}
_INT32 = frozenset({"segment.bytes", "min.insync.replicas", "max.message.bytes"})  # the broker's INT configs
_ONE_OF = {"compression.type": {"uncompressed", "zstd", "lz4", "snappy", "gzip", "producer"},
           "message.timestamp.type": {"CreateTime", "LogAppendTime"}}
# Retention that deletes what it holds at once (0; a byte bound under a segment): refused, whatever a reader meant.
_RETENTION_AT_LEAST = {"retention.ms": 3_600_000, "retention.bytes": 1024 * 1024}
# Read from partition 0 alone (the lag readings, the operator log, the endpoint states, the audit trail): records
# keyed to another partition would never be read.
SINGLE_PARTITION = frozenset({"notif.lag", "notif.operator", "notif.endpoint.state", "notif.audit"})
_FIELDS = {"name", "partitions", "replication_factor", "config", "description"}
_CLEANUP = {"delete", "compact", "compact,delete", "delete,compact"}
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


@dataclass(frozen=True)
class Profile:
    """How many copies of every partition a deployment keeps, and how many must acknowledge a
    write (`acks=all`) before it counts: the topics' `min.insync.replicas`."""

    name: str
    replication_factor: int
    min_insync_replicas: int


PROFILES: dict[str, Profile] = {
    "dev": Profile("dev", 1, 1),          # one broker: the local stack, the tests
    "cluster": Profile("cluster", 3, 2),  # three brokers or more: one may fail without losing a write
}


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    replication_factor: int
    config: dict[str, str] = field(default_factory=dict)
    source: str = ""  # "file: [[topic]] #n", for messages


@dataclass(frozen=True)
class TopicState:
    """What the cluster has: partition count and the topic-level config overrides."""

    partitions: int
    replication_factor: int
    overrides: dict[str, str]


@dataclass(frozen=True)
class Change:
    topic: str
    kind: str  # create | add_partitions | add_replicas | set_config | delete_config | refused
    detail: str
    key: str = ""
    value: str = ""
    partitions: int = 0
    replication_factor: int = 0  # add_replicas: the new replication factor

    def __str__(self) -> str:
        return f"{self.kind:<15} {self.topic}: {self.detail}"


def _fail(where: str, msg: str) -> ConfigError:
    return ConfigError(f"{where}: {msg}")


def _expand(name: str, where: str) -> list[str]:
    keys = [f for _, f, _, _ in string.Formatter().parse(name) if f is not None]
    for key in keys:
        if key not in PLACEHOLDERS:
            raise _fail(where, f"field 'name': unknown placeholder {{{key}}} "
                               f"(known: {', '.join('{' + k + '}' for k in PLACEHOLDERS)})")
    unique = list(dict.fromkeys(keys))
    names = []
    for values in itertools.product(*(PLACEHOLDERS[k] for k in unique)):
        names.append(name.format(**dict(zip(unique, values, strict=True))))
    return names


def _positive_int(raw: object, where: str, fld: str) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
        raise _fail(where, f"field '{fld}' must be an integer >= 1, got {raw!r}")
    return raw


def _check_config_values(config: dict[str, str], where: str) -> None:
    """Values the broker would refuse, or that would stop every write, are refused here, before anything is applied
    (`apply` creates topics before it alters configs: a value refused by the broker would leave a half-applied
    plan)."""
    for key, least in _INTEGER_AT_LEAST.items():
        most = 2**31 - 1 if key in _INT32 else 2**63 - 1
        if key in config and (not re.fullmatch(r"-?[0-9]+", config[key]) or not least <= int(config[key]) <= most):
            raise _fail(where, f"field 'config.{key}' must be an integer from {least} to {most}, got {config[key]!r}")
    for key, least in _RETENTION_AT_LEAST.items():
        if key in config and int(config[key]) != -1 and int(config[key]) < least:
            raise _fail(where, f"field 'config.{key}' must be -1 (no limit) or at least {least}, got {config[key]}: "
                               "the broker would delete what the topic holds at once")
    for key, allowed in _ONE_OF.items():
        if key in config and config[key] not in allowed:
            raise _fail(where, f"field 'config.{key}' must be one of {sorted(allowed)}, got {config[key]!r}")
    ratio = config.get("min.cleanable.dirty.ratio")
    if ratio is not None and not (re.fullmatch(r"[0-9]*\.?[0-9]+", ratio) and 0 <= float(ratio) <= 1):
        raise _fail(where, f"field 'config.min.cleanable.dirty.ratio' must be a number from 0 to 1, got {ratio!r}")


def parse_definitions(path: Path, text: str, namespace: str = "") -> list[TopicSpec]:
    """Parse one definition file into expanded topic specs; errors name file, topic and field."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    unknown_top = set(doc) - {"topic"}
    if unknown_top:
        raise ConfigError(f"{path}: unknown top-level key(s) {sorted(unknown_top)}; expected [[topic]] tables")
    specs = []
    for i, entry in enumerate(doc.get("topic", []), start=1):
        where = f"{path}: [[topic]] #{i}"
        if not isinstance(entry, dict):
            raise _fail(where, "must be a table")
        raw_name = entry.get("name")
        if not isinstance(raw_name, str) or not raw_name:
            raise _fail(where, "field 'name' is required and must be a non-empty string")
        where = f"{path}: topic '{raw_name}'"
        extra = set(entry) - _FIELDS
        if extra:
            raise _fail(where, f"unknown field(s) {sorted(extra)} (allowed: {sorted(_FIELDS)})")
        partitions = _positive_int(entry.get("partitions"), where, "partitions")
        rf = _positive_int(entry.get("replication_factor"), where, "replication_factor")
        raw_config = entry.get("config", {})
        if not isinstance(raw_config, dict):
            raise _fail(where, "field 'config' must be a table of topic configs")
        config: dict[str, str] = {}
        for key, value in raw_config.items():
            if key not in KNOWN_CONFIGS:
                raise _fail(where, f"field 'config.{key}' is not a known topic config "
                                   f"(known: {', '.join(sorted(KNOWN_CONFIGS))})")
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise _fail(where, f"field 'config.{key}' must be a string or a number, got {value!r}")
            config[key] = str(value)
        policy = config.get("cleanup.policy")
        if policy is not None and policy not in _CLEANUP:
            raise _fail(where, f"field 'config.cleanup.policy' must be one of {sorted(_CLEANUP)}, got {policy!r}")
        _check_config_values(config, where)
        for name in _expand(raw_name, where):
            if name in SINGLE_PARTITION and partitions != 1:
                raise _fail(where, f"field 'partitions' must be 1, got {partitions}: {name} is read from its "
                                   "partition 0 alone")
            full = namespace + name
            if not _NAME.fullmatch(full) or len(full) > 249:
                raise _fail(where, f"field 'name' expands to an invalid Kafka topic name {full!r}")
            specs.append(TopicSpec(full, partitions, rf, dict(config), source=where))
    return specs


def topics_dir(override: str | Path | None = None) -> Path:
    """Where the topic definitions are: `override`, else the repository's `topics/`, else ./topics."""
    if override:
        return Path(override)
    return REPO_TOPICS if REPO_TOPICS.is_dir() else Path.cwd() / "topics"


def topic_profile(name: str) -> Profile:
    """The replication profile called `name` (ConfigError naming the known ones)."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ConfigError(f"unknown topic profile {name!r} (known: {', '.join(PROFILES)})") from None


def apply_profile(specs: dict[str, TopicSpec], chosen: Profile) -> dict[str, TopicSpec]:
    """Every topic with the profile's replication factor and `min.insync.replicas`. A definition
    that sets `min.insync.replicas` itself keeps it, if the profile's replicas can satisfy it."""
    out = {}
    for name, spec in specs.items():
        config = dict(spec.config)
        own = config.get("min.insync.replicas")
        if own is None:
            config["min.insync.replicas"] = str(chosen.min_insync_replicas)
        elif not own.isdigit() or not 1 <= int(own) <= chosen.replication_factor:
            raise ConfigError(f"{spec.source}: field 'config.min.insync.replicas' = {own} cannot be met with "
                              f"the {chosen.name!r} profile's {chosen.replication_factor} replica(s)")
        out[name] = TopicSpec(spec.name, spec.partitions, chosen.replication_factor, config, spec.source)
    return out


def load_definitions(directory: Path | None = None, namespace: str = "",
                     profile: str | Profile | None = None) -> dict[str, TopicSpec]:
    """Load every `*.toml` under `directory` (default: `topics_dir()`); a topic defined twice is an error.
    With a `profile` (a name of PROFILES, or a Profile), every topic takes its replication settings."""
    directory = directory or topics_dir()
    files = sorted(directory.glob("*.toml"))
    if not files:
        raise ConfigError(f"{directory}: no topic definition files (*.toml) found")
    specs: dict[str, TopicSpec] = {}
    for path in files:
        for spec in parse_definitions(path, path.read_text(), namespace):
            if spec.name in specs:
                raise ConfigError(f"{spec.source}: topic {spec.name!r} is already defined by "
                                  f"{specs[spec.name].source}")
            specs[spec.name] = spec
    _check_retry_partitions(specs)
    if profile is None:
        _check_insync_replicas(specs)
        return specs
    return apply_profile(specs, topic_profile(profile) if isinstance(profile, str) else profile)


def _check_insync_replicas(specs: dict[str, TopicSpec]) -> None:
    """As written (no profile), a topic's min.insync.replicas within its replicas (`apply_profile` checks a
    profile's): more, and every write acknowledged by all in-sync replicas is refused, for good."""
    for spec in specs.values():
        insync = spec.config.get("min.insync.replicas")
        if insync is not None and int(insync) > spec.replication_factor:
            raise ConfigError(f"{spec.source}: field 'config.min.insync.replicas' = {insync} is more than its "
                              f"replication_factor ({spec.replication_factor}): no write could be acknowledged "
                              "(raise the replication with a profile: --profile / DUAL_RAIL_TOPIC_PROFILE)")


def _check_retry_partitions(specs: dict[str, TopicSpec]) -> None:
    """Retry and DLQ topics need at least the lane's partitions (the DLQ: the most of any lane's), or they
    become a bottleneck."""
    lanes = [s for s in specs.values() if re.match(rf"^.*notif\.[a-z]+\.({'|'.join(LANES)})$", s.name)]
    for spec in specs.values():
        match = re.match(r"^(.*notif\.[a-z]+\.[a-z]+)\.retry\.", spec.name)
        lane = specs.get(match.group(1)) if match else None
        if spec.name.endswith("notif.dlq"):
            lane = max(lanes, key=lambda s: s.partitions, default=None)
        if lane and spec.partitions < lane.partitions:
            raise ConfigError(f"{spec.source}: field 'partitions': {spec.name} has {spec.partitions} "
                              f"partitions, fewer than its lane {lane.name} ({lane.partitions})")


# Topics whose partition count something else is built on: growing one is refused, like shrinking any.
PARTITIONS_BUILT_ON = {
    "notif.webhook.attempts": "the endpoint-health app's table has one changelog partition per attempts partition "
                              "and keeps each endpoint's count where its events land: grown alone, every copy of "
                              "the app stops at its start (TopicPlanError) and no endpoint is degraded or alerted "
                              "on; grow it deliberately with its changelog (docs/runbook.md, EndpointHealthBehind)",
}


def plan(desired: dict[str, TopicSpec], actual: dict[str, TopicState]) -> list[Change]:
    """The changes that make the cluster match the definitions. Never deletes topics."""
    changes: list[Change] = []
    for name, spec in sorted(desired.items()):
        state = actual.get(name)
        if state is None:
            changes.append(Change(name, "create", f"{spec.partitions} partitions, replication "
                                  f"{spec.replication_factor}, config {spec.config}",
                                  partitions=spec.partitions))
            continue
        built_on = next((why for topic, why in PARTITIONS_BUILT_ON.items() if name.endswith(topic)), None)
        if spec.partitions > state.partitions and built_on:
            changes.append(Change(name, "refused", f"partitions {state.partitions} -> {spec.partitions}: {built_on}"))
        elif spec.partitions > state.partitions:
            changes.append(Change(name, "add_partitions", f"{state.partitions} -> {spec.partitions}",
                                  partitions=spec.partitions))
        elif spec.partitions < state.partitions:
            changes.append(Change(
                name, "refused",
                f"partitions {state.partitions} -> {spec.partitions}: Kafka cannot remove partitions, "
                "and fewer partitions would remap tenant keys and strand unconsumed messages; "
                "recreate the topic deliberately instead"))
        if spec.replication_factor > state.replication_factor:
            changes.append(Change(
                name, "add_replicas",
                f"replication factor {state.replication_factor} -> {spec.replication_factor} "
                "(partition reassignment: new replicas copy each partition; leaders stay)",
                replication_factor=spec.replication_factor))
        elif spec.replication_factor < state.replication_factor:
            changes.append(Change(
                name, "refused",
                f"replication factor {state.replication_factor} -> {spec.replication_factor}: lowering it "
                "throws away copies of every partition, and with them the writes a broker failure would "
                "otherwise keep; this tool only raises a replication factor (check the topic profile: "
                "`--profile` / DUAL_RAIL_TOPIC_PROFILE)"))
        # The broker's default policy is delete: an override saying so, or none, is the same policy.
        refused = {"cleanup.policy"} if (spec.config.get("cleanup.policy", "delete")
                                         != state.overrides.get("cleanup.policy", "delete")) else set()
        if refused:
            changes.append(Change(
                name, "refused",
                f"cleanup.policy {state.overrides.get('cleanup.policy', '(default)')} -> "
                f"{spec.config.get('cleanup.policy', '(default)')}: compaction keeps one record per key (a lane's "
                "sends share their tenant's key), and a compacted log left to deletion loses the state it holds; "
                "change it by hand, deliberately, if it is meant"))
        for key, value in sorted(spec.config.items()):
            if key not in refused and state.overrides.get(key) != value:
                changes.append(Change(name, "set_config",
                                      f"{key}: {state.overrides.get(key, '(default)')} -> {value}",
                                      key=key, value=value))
        for key in sorted(set(state.overrides) - set(spec.config) - refused):
            changes.append(Change(name, "delete_config",
                                  f"{key}: {state.overrides[key]} -> (default)", key=key))
    return changes


def channel_specs(specs: dict[str, TopicSpec], namespace: str, channels: tuple[str, ...]) -> dict[str, TopicSpec]:
    """The topics one or more channels need: their lanes and retry tiers, plus the shared
    `notif.dlq`, `notif.outcomes`, `notif.lag`, `notif.operator`, `notif.endpoint.state` and `notif.audit`."""
    shared = {f"{namespace}notif.{t}" for t in ("dlq", "outcomes", "lag", "operator", "endpoint.state", "audit")}
    prefixes = tuple(f"{namespace}notif.{c}." for c in channels)
    return {n: s for n, s in specs.items() if n in shared or n.startswith(prefixes)}
