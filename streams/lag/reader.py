"""Reading a consumer group's lag from the cluster (AdminClient adapter).

Lag in messages = sum over partitions of (log-end offset - committed offset), each clamped at
zero: the two offsets are not read atomically, so a commit landing in between could otherwise
make it negative. A group without a commit counts from the earliest offset. Lag in seconds is
the age of the oldest unconsumed message (its timestamp at the committed offset).
"""

from __future__ import annotations

import time

from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from ..errors import StackError
from ..kafka_client import client_config
from .yield_policy import LagReading

TIMEOUT_S = 5.0


class LagReader:
    def __init__(self, bootstrap: str):
        self.admin = AdminClient(client_config(bootstrap, quiet=True))
        self.peeker = Consumer(client_config(bootstrap, quiet=True, settings={
            "group.id": "lag-reader-peek", "enable.auto.commit": False, "fetch.wait.max.ms": 10}))
        self._partitions: dict[str, list[int]] = {}

    def partitions(self, topic: str) -> list[int]:
        if topic not in self._partitions:
            md = self.admin.list_topics(topic, timeout=TIMEOUT_S)
            if md.topics[topic].error is not None:
                raise StackError(f"cannot read lag: topic {topic} ({md.topics[topic].error})")
            self._partitions[topic] = sorted(md.topics[topic].partitions)
        return self._partitions[topic]

    def read(self, group: str, topic: str, source: str = "monitor") -> LagReading:
        try:
            parts = [TopicPartition(topic, p) for p in self.partitions(topic)]
            committed_f = self.admin.list_consumer_group_offsets(
                [ConsumerGroupTopicPartitions(group, parts)], request_timeout=TIMEOUT_S)
            committed = {tp.partition: tp.offset for tp in committed_f[group].result().topic_partitions}
            ends = self._offsets(parts, OffsetSpec.latest())
            starts = self._offsets(parts, OffsetSpec.earliest())
        except KafkaException as exc:
            raise StackError(f"cannot read the lag of {group} on {topic}: {exc}") from None
        now_ms = int(time.time() * 1000)
        lag = 0
        heads = []
        for p in ends:
            position = committed.get(p, -1)
            if position < 0:
                position = starts[p]
            behind = max(0, ends[p] - position)
            lag += behind
            if behind:
                heads.append(TopicPartition(topic, p, position))
        oldest_ts = self._oldest_timestamp(heads)
        lag_s = max(0.0, (now_ms - oldest_ts) / 1000) if oldest_ts else 0.0
        return LagReading(lag, lag_s, now_ms, source)

    def _offsets(self, parts: list[TopicPartition], spec) -> dict[int, int]:
        futures = self.admin.list_offsets({tp: spec for tp in parts}, request_timeout=TIMEOUT_S)
        return {tp.partition: f.result().offset for tp, f in futures.items()}

    def _oldest_timestamp(self, heads: list[TopicPartition]) -> int | None:
        """Timestamp of the oldest message among the partitions' first unconsumed ones."""
        if not heads:
            return None
        self.peeker.assign(heads)
        found: dict[int, int] = {}
        deadline = time.monotonic() + 1.0
        while len(found) < len(heads) and time.monotonic() < deadline:
            for m in self.peeker.consume(num_messages=len(heads) * 4, timeout=0.1):
                if not m.error() and m.partition() not in found:
                    found[m.partition()] = m.timestamp()[1]
        self.peeker.unassign()
        return min(found.values()) if found else None

    def close(self) -> None:
        self.peeker.close()
