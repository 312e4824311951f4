"""Webhook endpoints: what tenants register, where it is kept, and the view workers follow.

An endpoint belongs to one tenant: a URL, a description, the event types it subscribes to (`*` for
all), `enabled` (the tenant's switch), a health `state` (`active`, `degraded`, `disabled`) and its
signing secrets (the current one first; after a rotation the previous one stays valid 24 h, and
both sign). Like all operator state, endpoints are written first to the operator log (the
compacted `notif.operator`, key `endpoint/<id>`), then to Redis for the API's reads; workers
follow the log itself (`EndpointDirectory`), so a change reaches them within a poll, and Redis
losing its data loses no endpoint.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import orjson
import redis
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from ..errors import ConfigError
from ..kafka_client import client_config
from ..names import RedisKeys
from ..redis_client import store_errors
from ..state.log import OperatorLog
from .signing import new_secret
from .ssrf import Resolver, UnsafeUrl, UrlPolicy

ROTATION_OVERLAP_MS = 24 * 3600 * 1000
log = logging.getLogger("streams.endpoints")
STATES = ("active", "degraded", "disabled")


@dataclass(frozen=True)
class Secret:
    value: str
    expires_at_ms: int | None = None  # None: the current secret


@dataclass(frozen=True)
class Endpoint:
    id: str
    tenant: str
    url: str
    event_types: tuple[str, ...]
    description: str = ""
    enabled: bool = True
    state: str = "active"
    state_reason: str = ""
    secrets: tuple[Secret, ...] = ()
    created_at_ms: int = 0

    def subscribes(self, event_type: str) -> bool:
        return "*" in self.event_types or event_type in self.event_types

    @property
    def deliverable(self) -> bool:
        return self.enabled and self.state == "active"

    def signing_secrets(self, now_ms: int) -> list[str]:
        return [s.value for s in self.secrets if s.expires_at_ms is None or s.expires_at_ms > now_ms]

    def public(self) -> dict[str, Any]:
        """What the API shows (never the secrets)."""
        doc = asdict(self)
        doc.pop("secrets")
        doc["event_types"] = list(self.event_types)
        return doc

    def to_doc(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> Endpoint:
        return cls(**{**doc, "event_types": tuple(doc["event_types"]),
                      "secrets": tuple(Secret(**s) for s in doc.get("secrets", ()))})


def new_endpoint_id() -> str:
    return "ep_" + uuid.uuid4().hex[:20]


def check_event_types(event_types: list[str]) -> tuple[str, ...]:
    if not event_types or not all(isinstance(t, str) and 0 < len(t) <= 128 for t in event_types):
        raise ConfigError("event_types must list at least one event type (or '*'), each 1 to 128 characters")
    return tuple(dict.fromkeys(event_types))


class EndpointStore:
    """Endpoints in Redis (per tenant), written through the operator log."""

    def __init__(self, client: redis.Redis, namespace: str, oplog: OperatorLog | None, policy: UrlPolicy,
                 resolve: Resolver):
        self.client, self.keys, self.oplog = client, RedisKeys(namespace), oplog
        self.policy, self.resolve = policy, resolve

    def _check_url(self, url: str) -> str:
        try:
            self.policy.check(url, self.resolve)
        except UnsafeUrl as exc:
            raise ConfigError(f"url: {exc}") from None
        return url

    def _save(self, ep: Endpoint) -> Endpoint:
        if self.oplog is not None:
            self.oplog.put(f"endpoint/{ep.id}", ep.to_doc())
        with store_errors("saving an endpoint"):
            self.client.hset(self.keys.endpoints(ep.tenant), ep.id, orjson.dumps(ep.to_doc()))
        return ep

    def create(self, tenant: str, url: str, event_types: list[str], description: str = "",
               enabled: bool = True) -> tuple[Endpoint, str]:
        """A new endpoint and its signing secret (shown once)."""
        secret = new_secret()
        ep = Endpoint(new_endpoint_id(), tenant, self._check_url(url), check_event_types(event_types),
                      description[:500], enabled, secrets=(Secret(secret),), created_at_ms=int(time.time() * 1000))
        return self._save(ep), secret

    def get(self, tenant: str, endpoint_id: str) -> Endpoint | None:
        with store_errors("reading an endpoint"):
            raw = self.client.hget(self.keys.endpoints(tenant), endpoint_id)
        return Endpoint.from_doc(orjson.loads(raw)) if raw else None

    def all(self, tenant: str) -> list[Endpoint]:
        with store_errors("listing endpoints"):
            raw = self.client.hgetall(self.keys.endpoints(tenant))
        return sorted((Endpoint.from_doc(orjson.loads(v)) for v in raw.values()), key=lambda e: e.created_at_ms)

    def subscribers(self, tenant: str, event_type: str) -> list[Endpoint]:
        """The endpoints a new event of this type is delivered to: enabled, active, subscribed."""
        return [e for e in self.all(tenant) if e.deliverable and e.subscribes(event_type)]

    def update(self, tenant: str, endpoint_id: str, *, url: str | None = None, description: str | None = None,
               event_types: list[str] | None = None, enabled: bool | None = None) -> Endpoint | None:
        ep = self.get(tenant, endpoint_id)
        if ep is None:
            return None
        changes: dict[str, Any] = {}
        if url is not None:
            changes["url"] = self._check_url(url)
        if description is not None:
            changes["description"] = description[:500]
        if event_types is not None:
            changes["event_types"] = check_event_types(event_types)
        if enabled is not None:
            changes["enabled"] = enabled
        return self._save(replace(ep, **changes))

    def delete(self, tenant: str, endpoint_id: str) -> bool:
        if self.get(tenant, endpoint_id) is None:
            return False
        if self.oplog is not None:
            self.oplog.put(f"endpoint/{endpoint_id}", None)
        with store_errors("deleting an endpoint"):
            self.client.hdel(self.keys.endpoints(tenant), endpoint_id)
        return True

    def rotate_secret(self, tenant: str, endpoint_id: str, now_ms: int | None = None) -> str | None:
        """A new current secret; the previous one stays valid 24 h (both sign meanwhile)."""
        ep = self.get(tenant, endpoint_id)
        if ep is None:
            return None
        now_ms = now_ms or int(time.time() * 1000)
        kept = [s if s.expires_at_ms is not None else Secret(s.value, now_ms + ROTATION_OVERLAP_MS)
                for s in ep.secrets if s.expires_at_ms is None or s.expires_at_ms > now_ms]
        secret = new_secret()
        self._save(replace(ep, secrets=(Secret(secret), *kept)))
        return secret

    def set_state(self, tenant: str, endpoint_id: str, state: str, reason: str = "") -> Endpoint | None:
        """Health changes: `disabled` after a 410, `degraded` after repeated failures, `active` again on
        reactivation."""
        if state not in STATES:
            raise ConfigError(f"unknown endpoint state {state!r} (states: {', '.join(STATES)})")
        ep = self.get(tenant, endpoint_id)
        return None if ep is None else self._save(replace(ep, state=state, state_reason=reason))


@dataclass
class EndpointDirectory:
    """Every endpoint, as the operator log says now: workers follow the log from its start, so a
    change (a new URL, a rotated secret, a disabled endpoint) reaches them within a poll. Reads from
    other threads see a consistent snapshot (the dict is replaced, never changed in place)."""

    bootstrap: str
    topic: str
    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    caught_up: bool = False
    _consumer: Consumer | None = None
    _end: int | None = None  # the log's end when we started: caught up once read to here
    _position: int = 0

    def start(self) -> None:
        self._consumer = Consumer(client_config(self.bootstrap, quiet=True, settings={
            "group.id": f"endpoint-directory-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False}))
        self._consumer.assign([TopicPartition(self.topic, 0, OFFSET_BEGINNING)])

    def _learn_end(self) -> None:
        """The end offset to catch up to (asked again on the next poll while the broker cannot say)."""
        assert self._consumer is not None
        try:
            low, high = self._consumer.get_watermark_offsets(TopicPartition(self.topic, 0), timeout=1, cached=False)
        except Exception as exc:  # noqa: BLE001 - e.g. a leader not elected yet: ask again next poll
            log.debug("operator log %s end not known yet: %s", self.topic, exc)
            return
        self._end = high
        self.caught_up = self._position >= high or high == low

    def poll(self) -> None:
        """Apply what the log has gained since the last poll (never blocks long)."""
        if self._consumer is None:
            return
        if self._end is None:
            self._learn_end()
        changed = dict(self.endpoints)
        for m in self._consumer.consume(num_messages=1000, timeout=0):
            if m.error():
                continue
            key = (m.key() or b"").decode()
            self._position = m.offset() + 1
            if self._end is not None and self._position >= self._end:
                self.caught_up = True
            if not key.startswith("endpoint/"):
                continue
            endpoint_id = key.removeprefix("endpoint/")
            if m.value() is None:
                changed.pop(endpoint_id, None)
            else:
                changed[endpoint_id] = Endpoint.from_doc(orjson.loads(m.value()))
        if len(changed) != len(self.endpoints) or any(self.endpoints.get(k) is not v for k, v in changed.items()):
            self.endpoints = changed

    def get(self, endpoint_id: str) -> Endpoint | None:
        return self.endpoints.get(endpoint_id)

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
