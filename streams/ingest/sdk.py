"""The Python SDK producers use: validate, assign the send id, pick the lane, publish durably.

    from streams import SendClient
    client = SendClient(bootstrap)
    send_id = client.publish("acme", {"channel": "email", "category": "transactional", ...})

The lane comes from the category, never from the caller, so a marketing send cannot enter the
transactional lane. A batch is validated whole before anything is published, and published whole
(a Kafka transaction) or not at all.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import orjson

from ..config import retry_policies_path
from ..errors import SendTooLarge, SendValidationError
from ..names import TopicNames
from ..outcomes import OUTCOMES_PER_RECORD, accepted_events
from ..retry.policy import PolicyRouting, default_routing, load_policies, load_routing
from ..send import MAX_SEND_BYTES, Send, build_send, encode, new_send_id, uncarried_errors, validate_batch
from .publisher import Publisher, Record, Written

Router = Callable[[Send], str]


def lane_topic(names: TopicNames) -> Router:
    """The production routing: each send to its own channel's lane topic."""
    return lambda send: names.lane(send.channel, send.lane)


class SendClient:
    def __init__(self, bootstrap: str, names: TopicNames | None = None,
                 known_policies: frozenset[str] | None = None, timeout_s: float = 30.0,
                 router: Router | None = None, routing: PolicyRouting | None = None,
                 txn_instance: str | None = None):
        self.bootstrap = bootstrap
        self.names = names or TopicNames()
        self.route = router or lane_topic(self.names)
        # Without them given, the retry policies the workers read (DUAL_RAIL_RETRY_POLICIES, else the packaged file):
        # a send naming another (a misspelt one) is refused here, not accepted and dead-lettered `unknown_policy`.
        path = retry_policies_path()
        self.known_policies = known_policies if known_policies is not None else frozenset(load_policies(path))
        self.routing = routing or (load_routing(path) if path else default_routing())  # for a send naming none
        self.timeout_s = timeout_s
        # Records written once, in order, acknowledged by all in-sync replicas; several at once in a
        # transaction (all or nothing).
        self.publisher = Publisher(bootstrap, self.names.namespace, timeout_s=timeout_s, instance=txn_instance)
        self.producer = self.publisher.single  # for single records of other kinds (put_acked)

    def publish(self, tenant_id: str, request: dict, idempotency_key: str | None = None) -> str:
        """Validate and publish one send; returns its send id once the broker has it."""
        return self.publish_batch(tenant_id, [request], idempotency_key)[0]

    def publish_batch(self, tenant_id: str, requests: list[dict], idempotency_key: str | None = None) -> list[str]:
        """Validate every send first (any error rejects the whole batch), then publish them all or none.
        With `idempotency_key`, the send ids are derived from (tenant, key, position), not from the sends'
        content: publishing the same batch again under the same key (rebuilt, a timestamp in it changed) gives
        the same ids, and dispatch delivers each id once. So a key names one batch for good: other sends under
        it would be taken for the first ones and never sent (nothing is ever sent twice by a retry).
        (Such ids do not sort by creation time; the HTTP API keeps the first answer instead.)"""
        valid = validate_batch(requests, self.known_policies)
        if errors := uncarried_errors([r.payload for r in valid], lambda i: [i, "payload"]):
            raise SendValidationError(errors)
        if any(r.channel == "webhook" for r in valid):
            raise SendValidationError([{"loc": ("channel",), "msg": "a webhook event fans out to the tenant's "
                                        "endpoints: publish it through the ingest API (POST /v1/sends)"}])
        ids = [keyed_send_id(tenant_id, idempotency_key, i, 0) if idempotency_key else None
               for i in range(len(valid))]
        sends = [build_send(r, tenant_id, routing=self.routing, send_id=ids[i]) for i, r in enumerate(valid)]
        # Their `accepted` status (GET /v1/sends/{id}) comes from notif.outcomes, through the outcome recorder: in
        # a batch's own transaction; for one send (an OTP), after its acknowledgement, not waited for.
        if len(sends) == 1:
            self.publish_sends(sends)
            self.publisher.publish_unwaited(self.accepted_records(sends))
        else:
            self.publisher.publish(self.records(sends) + self.accepted_records(sends))
        return [s.send_id for s in sends]

    def accepted_records(self, sends: list[Send]) -> list[Record]:
        now = int(time.time() * 1000)
        return [Record(self.names.outcomes, chunk[0].send_id.encode(),
                       orjson.dumps({"events": accepted_events(chunk, now)}))
                for chunk in (sends[i:i + OUTCOMES_PER_RECORD] for i in range(0, len(sends), OUTCOMES_PER_RECORD))]

    def records(self, sends: list[Send]) -> list[Record]:
        """Each send as the record its lane topic gets; SendTooLarge names a send over the limit."""
        out = []
        for i, send in enumerate(sends):
            value = encode(send)
            if len(value) > MAX_SEND_BYTES:
                raise SendTooLarge(i, len(value))
            out.append(Record(self.route(send), send.tenant_id.encode(), value, (("send_id", send.send_id.encode()),)))
        return out

    def publish_sends(self, sends: list[Send]) -> list[Written]:
        """All or none: the broker acknowledged every one, or PublishError and none is dispatched, or
        PublishOutcomeUnknown: all or none may be (publish them again under the same send ids)."""
        return self.publisher.publish(self.records(sends))

    async def publish_sends_async(self, sends: list[Send]) -> list[Written]:
        return await self.publisher.publish_async(self.records(sends))

    def close(self) -> None:
        self.publisher.close()


def keyed_send_id(tenant_id: str, idempotency_key: str, position: int, first_ms: int) -> str:
    """The send id of the `position`-th send of an idempotent request: the same for the same tenant,
    key and position (its time part is the key's first use, `first_ms`)."""
    return new_send_id(first_ms, f"{tenant_id}\x00{idempotency_key}\x00{position}".encode())
