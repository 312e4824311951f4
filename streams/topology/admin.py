"""Reads topic state from a cluster and applies a plan (confluent-kafka AdminClient adapter)."""

from __future__ import annotations

import time

from confluent_kafka import KafkaException
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ConfigSource,
    NewPartitions,
    NewTopic,
    ResourceType,
)

from ..errors import StackError, TopicPlanError
from ..kafka_client import client_config
from .spec import Change, TopicSpec, TopicState, plan

TIMEOUT_S = 30.0


class TopicAdmin:
    def __init__(self, bootstrap: str):
        self.bootstrap = bootstrap
        self.admin = AdminClient(client_config(bootstrap, quiet=True))

    def state(self, names: list[str]) -> dict[str, TopicState]:
        """Partitions and topic-level overrides of those of `names` that exist."""
        try:
            md = self.admin.list_topics(timeout=10.0)
        except KafkaException as exc:
            raise StackError(f"cannot reach Kafka at {self.bootstrap} ({exc.args[0].str()}); "
                             "is the stack up? (`streams dev up`)") from None
        present = [n for n in names if n in md.topics and md.topics[n].error is None]
        if not present:
            return {}
        resources = [ConfigResource(ResourceType.TOPIC, n) for n in present]
        configs = {}
        for res, fut in self.admin.describe_configs(resources, request_timeout=TIMEOUT_S).items():
            entries = fut.result()
            configs[res.name] = {
                k: e.value for k, e in entries.items()
                if e.source == ConfigSource.DYNAMIC_TOPIC_CONFIG.value
            }
        out = {}
        for name in present:
            parts = md.topics[name].partitions
            rf = len(next(iter(parts.values())).replicas) if parts else 0
            out[name] = TopicState(len(parts), rf, configs.get(name, {}))
        return out

    def apply(self, changes: list[Change], specs: dict[str, TopicSpec]) -> None:
        refused = [c for c in changes if c.kind == "refused"]
        if refused:
            raise TopicPlanError("refusing to apply:\n" + "\n".join(f"  {c}" for c in refused))
        creates = [specs[c.topic] for c in changes if c.kind == "create"]
        if creates:
            self._wait(self.admin.create_topics(
                [NewTopic(s.name, num_partitions=s.partitions, replication_factor=s.replication_factor,
                          config=s.config) for s in creates], request_timeout=TIMEOUT_S))
            self._wait_visible({s.name: s.partitions for s in creates})
        grows = [NewPartitions(c.topic, c.partitions) for c in changes if c.kind == "add_partitions"]
        if grows:
            self._wait(self.admin.create_partitions(grows, request_timeout=TIMEOUT_S))
            self._wait_visible({g.topic: g.new_total_count for g in grows})
        by_topic: dict[str, list[ConfigEntry]] = {}
        for c in changes:
            if c.kind == "set_config":
                by_topic.setdefault(c.topic, []).append(
                    ConfigEntry(c.key, c.value, incremental_operation=AlterConfigOpType.SET))
            elif c.kind == "delete_config":
                by_topic.setdefault(c.topic, []).append(
                    ConfigEntry(c.key, None, incremental_operation=AlterConfigOpType.DELETE))
        if by_topic:
            self._wait(self.admin.incremental_alter_configs(
                [ConfigResource(ResourceType.TOPIC, t, incremental_configs=e) for t, e in by_topic.items()],
                request_timeout=TIMEOUT_S))

    def _wait_visible(self, expected: dict[str, int]) -> None:
        """The controller acknowledges before every broker's metadata shows the change; wait for it
        so that a plan right after an apply sees what was applied."""
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            md = self.admin.list_topics(timeout=10.0)
            if all(n in md.topics and md.topics[n].error is None
                   and len(md.topics[n].partitions) >= p
                   and all(pm.leader >= 0 for pm in md.topics[n].partitions.values())
                   for n, p in expected.items()):
                return
            time.sleep(0.1)
        raise StackError(f"topics not visible in metadata after {TIMEOUT_S:.0f} s: {sorted(expected)}")

    def ensure(self, specs: dict[str, TopicSpec]) -> None:
        """Create or reconcile exactly these topics (tests, benchmarks and the demo use a subset)."""
        self.apply(plan(specs, self.state(list(specs))), specs)

    def delete(self, names: list[str]) -> None:
        """Delete topics (tests clean up their own namespaces with this)."""
        if names:
            self._wait(self.admin.delete_topics(names, request_timeout=TIMEOUT_S))

    @staticmethod
    def _wait(futures: dict) -> None:
        errors = []
        for key, fut in futures.items():
            try:
                fut.result()
            except KafkaException as exc:
                errors.append(f"{getattr(key, 'name', key)}: {exc.args[0].str() if exc.args else exc}")
        if errors:
            raise StackError("the broker refused: " + "; ".join(errors))
