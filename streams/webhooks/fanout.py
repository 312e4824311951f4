"""One webhook event, one delivery per subscribed endpoint. Pure code.

The event gets an id (returned to the tenant); each delivery is a send of its own on the webhook
lane, with its own id (stable across its retries: the `webhook-id` receivers deduplicate by), the
event's payload, and the endpoint it goes to. A delivery to a degraded endpoint, or to one whose
backlog is extreme, is not enqueued: it is recorded as skipped (`skip_reason`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..retry.policy import PolicyRouting
from ..send import Send, SendRequest, build_send, new_send_id
from .model import Endpoint, Health


@dataclass(frozen=True)
class BacklogLimit:
    """When an endpoint's backlog is extreme (`backlog.py` says why both thresholds count)."""

    max_count: int = 10_000
    max_age_ms: int = 6 * 3600 * 1000

    def overdue_before_ms(self, now_ms: int) -> int:
        """A delivery created at or before this is overdue (at least max_age old)."""
        return now_ms - self.max_age_ms

    def extreme(self, overdue: int) -> bool:
        """`overdue`: how many of the endpoint's undelivered deliveries are at least max_age old. Counted one by
        one, not as the backlog's size and its oldest: one straggler in a retry tier beside a fresh burst is no
        endpoint days behind."""
        return overdue >= self.max_count


def fan_out(req: SendRequest, tenant: str, endpoints: list[Endpoint], routing: PolicyRouting | None = None,
            now_ms: int | None = None, id_for: Callable[[str], str] | None = None) -> tuple[str, list[Send]]:
    """The event id and its deliveries (none when no enabled endpoint subscribes to its type).
    `id_for(label)` gives the ids (an idempotent request derives them; otherwise they are new)."""
    new_id = id_for or (lambda _label: new_send_id(now_ms))
    event_id = new_id("event")
    deliveries = [build_send(req.model_copy(update={"payload": {**req.payload, "event_id": event_id,
                                                                "endpoint_id": ep.id}}),
                             tenant, now_ms, routing, send_id=new_id(ep.id))
                  for ep in endpoints]
    return event_id, deliveries


def skip_reason(health: Health | None, overdue: int, limit: BacklogLimit, disabled: bool = False) -> str | None:
    """Why a new delivery to an endpoint is recorded as skipped instead of enqueued (None: enqueue). `overdue`: its
    undelivered deliveries at least the limit's age old; `disabled`: the endpoint was disabled by a 410 Gone."""
    if disabled:
        return "endpoint_disabled"
    if health is not None and health.state == "degraded":
        return "endpoint_degraded"
    if limit.extreme(overdue):
        return "backlog_shed"
    return None
