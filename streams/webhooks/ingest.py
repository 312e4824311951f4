"""The webhook side of the ingest API: which deliveries of a new event are enqueued and which are
recorded as skipped, each endpoint's backlog, and reactivation.

Ingest follows `notif.endpoint.state` (an `EndpointDirectory` polled by a background thread every
0.1 s), so a degraded endpoint gets no new delivery within a fraction of a second of the
endpoint-health app publishing it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import orjson

from ..errors import ReplayNotYet, StoreUnavailable
from ..health.rules import reactivation_event
from ..ingest.members import MemberStore
from ..ingest.sdk import SendClient
from ..ingest.status import StatusStore
from ..kafka_client import put_acked
from ..send import Send
from .backlog import EndpointBacklog
from .endpoints import EndpointDirectory, EndpointStore
from .fanout import BacklogLimit, skip_reason
from .model import Endpoint, with_health

log = logging.getLogger("streams.webhooks")
FOLLOW_EVERY_S = 0.1


def reactivated_in_part(state_now: str) -> str:
    """What a reactivation whose health reset the broker did not confirm answers (`state_now`: the endpoint's
    state as deliveries see it: `degraded` while the endpoint-health app still holds it so, a 410 or not)."""
    return (f"the endpoint's configured state is active again, but the message broker did not confirm its health "
            f"reset (failure counter, alert window); it is {state_now} now"
            f"{'' if state_now == 'active' else ', and nothing is delivered to it until that reset goes through'}: "
            "reactivate it again to finish")


@dataclass
class WebhookIngest:
    endpoints: EndpointStore
    directory: EndpointDirectory
    backlog: EndpointBacklog
    limit: BacklogLimit
    members: MemberStore
    client: SendClient
    store: StatusStore
    # How long a request's admission may wait for the endpoint view to hold what the topics hold (0: it
    # does not wait). The bulk process sets it: its view must not lag what the API process, which
    # follows the same topics, has already shown the client (a reactivated endpoint, a new one).
    sync_view_s: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)

    def follow(self) -> None:
        """Keep the endpoint view current from a background thread."""
        def loop() -> None:
            while not self._stop.wait(FOLLOW_EVERY_S):
                try:
                    self.directory.poll()
                except Exception:  # noqa: BLE001 - the view goes stale, never the API down; logged
                    log.exception("following endpoint state failed; trying again")

        self.directory.poll()
        threading.Thread(target=loop, name="endpoint-state", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def current(self, ep: Endpoint) -> Endpoint:
        """The endpoint with its health (degraded) as the endpoint-health app published it."""
        return with_health(ep, self.directory.health.get(ep.id))

    def refuse_undeliverable_replay(self, new: Send) -> None:
        """Raises ReplayNotYet for a replay (`new`) the worker would skip: a webhook delivery whose endpoint was
        deleted, is disabled or not active (it only sends to a deliverable endpoint), saying what lets it
        through. An operator's replay is refused then, as a tenant's is; any other channel's passes."""
        if new.channel != "webhook":
            return
        endpoint_id, tenant = str(new.payload.get("endpoint_id", "")), new.tenant_id
        stored = self.endpoints.get(tenant, endpoint_id)
        current = self.current(stored) if stored is not None else None
        if current is not None and current.deliverable:
            return
        why = ("was deleted: nothing can deliver it" if current is None else
               "is disabled: the tenant enables it (PATCH enabled=true), then replay" if not current.enabled else
               f"is {current.state}: once its receiver is fixed, reactivate it (`streams endpoints reactivate "
               f"{endpoint_id} --tenant {tenant}`), then replay (reactivated a moment ago, it takes deliveries "
               "again within a few seconds: ask again then)")
        raise ReplayNotYet(f"send {new.replay_of} is a webhook delivery whose endpoint {endpoint_id} {why}; "
                           "nothing was replayed")

    def sync_view(self) -> None:
        """Before admitting a request's deliveries (see sync_view_s)."""
        if self.sync_view_s > 0 and not self.directory.sync(self.sync_view_s):
            log.warning("endpoint view not caught up within %.1f s: admitting with the view as it is",
                        self.sync_view_s)

    def admit(self, deliveries: list[Send], disabled: frozenset[str] = frozenset()
              ) -> tuple[list[Send], list[tuple[Send, str]]]:
        """The deliveries to enqueue, and those recorded as skipped with their reason (`disabled`: the ids of
        endpoints disabled by a 410 Gone)."""
        overdue = self.backlog.overdue([d.payload["endpoint_id"] for d in deliveries],
                                       self.limit.overdue_before_ms(int(time.time() * 1000)))
        enqueue, skipped = [], []
        for d in deliveries:
            endpoint_id = d.payload["endpoint_id"]
            reason = skip_reason(self.directory.health.get(endpoint_id), overdue[endpoint_id], self.limit,
                                 endpoint_id in disabled)
            if reason is None:
                enqueue.append(d)
            else:
                skipped.append((d, reason))
        return enqueue, skipped

    def enqueued(self, deliveries: list[Send]) -> None:
        """Count them in their endpoints' backlogs, before they are published (a delivery published first
        could be delivered, and removed by the outcome recorder, before it was counted: then it stayed
        counted for days). A Redis failure here only leaves the backlog short (shedding starts later), so
        it is logged, not raised."""
        try:
            self.backlog.enqueued(deliveries, int(time.time() * 1000))
        except StoreUnavailable as exc:
            log.warning("endpoint backlogs not updated for %d deliveries: %s", len(deliveries), exc)

    def withdrawn(self, deliveries: list[Send]) -> None:
        """Counted, then refused whole by the broker: out of the backlogs again (best effort, as above)."""
        try:
            self.backlog.withdrawn(deliveries)
        except StoreUnavailable as exc:
            log.warning("endpoint backlogs keep %d deliveries that were not published (forgotten after 3 days): %s",
                        len(deliveries), exc)

    # A reactivation is two steps: `set_active`, then `reset_health`. When the second fails, the first stands (a
    # 410's disable is lifted; an endpoint whose health is degraded stays so until the health app reads a reset):
    # callers say so (`reactivated_in_part`), and reactivating again finishes it.
    def set_active(self, tenant: str, endpoint_id: str) -> Endpoint | None:
        """Its configured state back to active (a 410 disables it); deliveries resume unless its health is degraded."""
        return self.endpoints.set_state(tenant, endpoint_id, "active", "reactivated")

    def reset_health(self, tenant: str, endpoint_id: str) -> None:
        """Its health: the endpoint-health app resets its failure counter and alert window when it reads this
        event, in line with the endpoint's attempts. PublishError: not confirmed."""
        event = reactivation_event(endpoint_id, tenant, int(time.time() * 1000))
        put_acked(self.client.producer, self.client.names.webhook_attempts, endpoint_id.encode(), orjson.dumps(event),
                  self.client.timeout_s, f"the reactivation of endpoint {endpoint_id}")
