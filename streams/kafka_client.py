"""The confluent-kafka adapter pieces every role shares: client settings, queueing a record, and
storing and committing tracked offsets. Each librdkafka setting says the guarantee it buys."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from confluent_kafka import Consumer, Producer, TopicPartition

from .offsets import OffsetTracker

_log = logging.getLogger("streams.kafka")
_quiet = logging.getLogger("streams.kafka.quiet")
_quiet.addHandler(logging.NullHandler())
_quiet.propagate = False


def client_config(bootstrap: str, quiet: bool = False, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """Common settings plus `settings`; `quiet` routes librdkafka's connection chatter to a silent logger."""
    conf: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        # librdkafka logs through Python logging instead of raw stderr lines.
        "logger": _quiet if quiet else _log,
    }
    conf.update(settings or {})
    return conf


def durable_producer(bootstrap: str, **extra: Any) -> Producer:
    """A producer whose records are written once, in order, and acknowledged by all in-sync replicas."""
    return Producer(client_config(bootstrap, settings={"enable.idempotence": True, "acks": "all", **extra}))


def lane_consumer(bootstrap: str, group: str, commit_interval_ms: int = 1000, **extra: Any) -> Consumer:
    """A consumer for at-least-once processing: offsets are stored by the caller once a message's
    outcome is durable, and auto-commit only ever commits what was stored."""
    return Consumer(client_config(bootstrap, settings={
        "group.id": group,
        # Rebalances move only the partitions that change owner; the rest keep flowing.
        "partition.assignment.strategy": "cooperative-sticky",
        "enable.auto.offset.store": False,
        "enable.auto.commit": True,
        "auto.commit.interval.ms": commit_interval_ms,
        "auto.offset.reset": "earliest",
        # A crashed member's partitions move to another member within ~10 s.
        "session.timeout.ms": 10_000,
        "heartbeat.interval.ms": 1_000,
        **extra,
    }))


def produce(producer: Producer, topic: str, value: bytes | None, key: bytes | None = None,
            headers: Iterable[tuple[str, bytes]] | None = None,
            on_delivery: Callable | None = None) -> None:
    """Queue one record; while librdkafka's local queue is full, serve delivery reports and retry."""
    while True:
        try:
            producer.produce(topic, value=value, key=key, headers=list(headers or ()), on_delivery=on_delivery)
            return
        except BufferError:
            producer.poll(0.1)


def store_offsets(consumer: Consumer, tracker: OffsetTracker, assigned: set[tuple[str, int]]) -> None:
    """Store, for each assigned partition, the lowest offset whose work is unfinished; auto-commit
    picks it up."""
    offsets = [TopicPartition(t, p, o) for (t, p), o in tracker.committable().items() if (t, p) in assigned]
    if offsets:
        try:
            consumer.store_offsets(offsets=offsets)
        except Exception as exc:  # noqa: BLE001 - a partition revoked meanwhile (_STATE) is benign
            _log.debug("store_offsets: %s", exc)


def commit_now(consumer: Consumer) -> None:
    """Commit what was stored, synchronously (on revoke and at shutdown)."""
    try:
        consumer.commit(asynchronous=False)
    except Exception as exc:  # noqa: BLE001 - "no offset stored" is not an error here
        _log.debug("commit: %s", exc)
