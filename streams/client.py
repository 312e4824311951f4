"""The Python SDK producers use: validate, assign the send id, pick the lane, publish durably.

    client = SendClient(bootstrap)
    send_id = client.publish("acme", {"channel": "email", "category": "transactional", ...})

The lane comes from the category, never from the caller, so a marketing send cannot enter the
transactional lane. A batch is validated whole before anything is published.
"""

from __future__ import annotations

from confluent_kafka import KafkaException, Producer

from .errors import DispatchError
from .kafka_config import client_config
from .lanes import TopicNames
from .send import Send, build_send, encode, validate_batch


class PublishError(DispatchError):
    """The broker did not acknowledge every send; the ones listed may not be enqueued."""


class SendClient:
    def __init__(self, bootstrap: str, names: TopicNames = TopicNames(),
                 known_policies: frozenset[str] | None = None, timeout_s: float = 30.0,
                 single_lane: bool = False):
        self.names = names
        # Benchmark baseline only (the naive design): every send in one shared lane topic.
        self.single_lane = single_lane
        self.known_policies = known_policies
        self.timeout_s = timeout_s
        self.producer = Producer(client_config(bootstrap, **{
            # No duplicates or reordering from producer retries; acknowledged by all in-sync replicas.
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 2,
            "compression.type": "lz4",
        }))

    def publish(self, tenant_id: str, request: dict) -> str:
        """Validate and publish one send; returns its send id once the broker has it."""
        return self.publish_batch(tenant_id, [request])[0]

    def publish_batch(self, tenant_id: str, requests: list[dict]) -> list[str]:
        """Validate every send first (any error rejects the whole batch), then publish them all."""
        sends = [build_send(r, tenant_id) for r in validate_batch(requests, self.known_policies)]
        self.publish_sends(sends)
        return [s.send_id for s in sends]

    def publish_sends(self, sends: list[Send]) -> None:
        failed: list[str] = []

        def on_delivery(err, msg) -> None:
            if err is not None:
                failed.append(f"{msg.key().decode()}: {err.str()}")

        for send in sends:
            topic = self.names.lane(send.channel, "marketing" if self.single_lane else send.lane)
            while True:
                try:
                    self.producer.produce(topic, key=send.tenant_id.encode(), value=encode(send),
                                          headers=[("send_id", send.send_id.encode())],
                                          on_delivery=on_delivery)
                    break
                except BufferError:
                    self.producer.poll(0.05)
                except KafkaException as exc:
                    raise PublishError(f"cannot publish to {topic}: {exc}") from None
        remaining = self.producer.flush(self.timeout_s)
        if remaining or failed:
            raise PublishError(f"{remaining} send(s) unacknowledged after {self.timeout_s:.0f} s; "
                               f"errors: {failed[:5]}")
