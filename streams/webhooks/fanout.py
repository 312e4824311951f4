"""One webhook event, one delivery per subscribed endpoint. Pure code.

The event gets an id (returned to the tenant); each delivery is a send of its own on the webhook
lane, with its own id (stable across its retries: the `webhook-id` receivers deduplicate by), the
event's payload, and the endpoint it goes to.
"""

from __future__ import annotations

from ..retry.policy import PolicyRouting
from ..send import Send, SendRequest, build_send, new_send_id
from .endpoints import Endpoint


def fan_out(req: SendRequest, tenant: str, endpoints: list[Endpoint], routing: PolicyRouting | None = None,
            now_ms: int | None = None) -> tuple[str, list[Send]]:
    """The event id and its deliveries (none when no enabled endpoint subscribes to its type)."""
    event_id = new_send_id(now_ms)
    deliveries = [build_send(req.model_copy(update={"payload": {**req.payload, "event_id": event_id,
                                                                "endpoint_id": ep.id}}),
                             tenant, now_ms, routing)
                  for ep in endpoints]
    return event_id, deliveries
