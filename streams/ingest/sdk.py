"""The Python SDK producers use: validate, assign the send id, pick the lane, publish durably.

    from streams import SendClient
    client = SendClient(bootstrap)
    send_id = client.publish("acme", {"channel": "email", "category": "transactional", ...})

The lane comes from the category, never from the caller, so a marketing send cannot enter the
transactional lane. A batch is validated whole before anything is published.
"""

from __future__ import annotations

from collections.abc import Callable

from confluent_kafka import KafkaException

from ..errors import PublishError, SendValidationError
from ..kafka_client import durable_producer, produce
from ..names import TopicNames
from ..retry.policy import PolicyRouting, default_routing
from ..send import Send, build_send, encode, validate_batch

Router = Callable[[Send], str]


def lane_topic(names: TopicNames) -> Router:
    """The production routing: each send to its own channel's lane topic."""
    return lambda send: names.lane(send.channel, send.lane)


class SendClient:
    def __init__(self, bootstrap: str, names: TopicNames | None = None,
                 known_policies: frozenset[str] | None = None, timeout_s: float = 30.0,
                 router: Router | None = None, routing: PolicyRouting | None = None):
        self.bootstrap = bootstrap
        self.names = names or TopicNames()
        self.route = router or lane_topic(self.names)
        self.known_policies = known_policies
        self.routing = routing or default_routing()  # which policy a send that names none gets
        self.timeout_s = timeout_s
        # No duplicates or reordering from producer retries; acknowledged by all in-sync replicas.
        self.producer = durable_producer(bootstrap, **{"linger.ms": 2, "compression.type": "lz4"})

    def publish(self, tenant_id: str, request: dict) -> str:
        """Validate and publish one send; returns its send id once the broker has it."""
        return self.publish_batch(tenant_id, [request])[0]

    def publish_batch(self, tenant_id: str, requests: list[dict]) -> list[str]:
        """Validate every send first (any error rejects the whole batch), then publish them all."""
        valid = validate_batch(requests, self.known_policies)
        if any(r.channel == "webhook" for r in valid):
            raise SendValidationError([{"loc": ("channel",), "msg": "a webhook event fans out to the tenant's "
                                        "endpoints: publish it through the ingest API (POST /v1/sends)"}])
        sends = [build_send(r, tenant_id, routing=self.routing) for r in valid]
        self.publish_sends(sends)
        return [s.send_id for s in sends]

    def publish_sends(self, sends: list[Send]) -> None:
        failed: list[str] = []

        def on_delivery(err, msg) -> None:
            if err is not None:
                failed.append(f"{msg.key().decode()}: {err.str()}")

        for send in sends:
            topic = self.route(send)
            try:
                produce(self.producer, topic, encode(send), key=send.tenant_id.encode(),
                        headers=[("send_id", send.send_id.encode())], on_delivery=on_delivery)
            except KafkaException as exc:
                raise PublishError(f"cannot publish to {topic}: {exc}") from None
        remaining = self.producer.flush(self.timeout_s)
        if remaining or failed:
            raise PublishError(f"{remaining} send(s) unacknowledged after {self.timeout_s:.0f} s; "
                               f"errors: {failed[:5]}")
