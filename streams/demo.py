"""`streams demo`: what a newcomer runs first. At this stage: a produce/consume round trip through
the lane topics of the local stack, timed end to end."""

from __future__ import annotations

import time
import uuid

from confluent_kafka import Consumer, Producer

from .kafka_config import client_config
from .lanes import CHANNELS, LANES, TopicNames
from .settings import StackSettings


def run_roundtrip(bootstrap: str, names: TopicNames = TopicNames(), timeout_s: float = 30.0) -> dict:
    """Publish one message to every lane topic and read each back through a fresh group."""
    topics = [names.lane(c, l) for c in CHANNELS for l in LANES]
    marker = uuid.uuid4().hex
    producer = Producer(client_config(bootstrap, **{"enable.idempotence": True, "acks": "all"}))
    sent_at = {}
    for topic in topics:
        sent_at[topic] = time.monotonic()
        producer.produce(topic, key=b"demo-tenant", value=f"{marker}:{topic}".encode())
    if producer.flush(timeout_s) != 0:
        raise RuntimeError("the broker did not acknowledge every demo message")
    consumer = Consumer(client_config(bootstrap, **{
        "group.id": f"demo-{marker}", "auto.offset.reset": "earliest", "enable.auto.commit": False}))
    consumer.subscribe(topics)
    latency_ms: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(latency_ms) < len(topics) and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            if msg.value() == f"{marker}:{msg.topic()}".encode():
                latency_ms[msg.topic()] = (time.monotonic() - sent_at[msg.topic()]) * 1000
                consumer.commit(message=msg, asynchronous=False)
    finally:
        consumer.close()
    return {"topics": len(topics), "round_trips": len(latency_ms), "latency_ms": latency_ms}


def main() -> int:
    settings = StackSettings.from_env()
    result = run_roundtrip(settings.bootstrap)
    for topic, ms in sorted(result["latency_ms"].items()):
        print(f"  {topic:<32} produced -> consumed -> committed in {ms:7.1f} ms")
    ok = result["round_trips"] == result["topics"]
    print(f"{result['round_trips']}/{result['topics']} lane topics round-tripped: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1
