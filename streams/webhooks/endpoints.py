"""Webhook endpoints (`model.py`): where they are kept, and the view workers follow.

Like all operator state, endpoints are written first to the operator log (the compacted
`notif.operator`, key `endpoint/<id>`), then to Redis for the API's reads; workers follow the log
itself (`EndpointDirectory`), so a change reaches them within a poll, and Redis losing its data
loses no endpoint. The directory also follows `notif.endpoint.state` (each endpoint's health) and
the project members kept in the operator log.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import orjson
import redis
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from ..errors import ConfigError, PublishOutcomeUnknown, StackError, StoreUnavailable
from ..kafka_client import client_config, watermarks
from ..names import RedisKeys
from ..redis_client import SET_FIELD_IF_UNCHANGED, load_script, store_errors
from ..send import EVENT_TYPE_PATTERN
from ..state.log import TIMEOUT_S as LOG_TIMEOUT_S
from ..state.log import OperatorLog, log_what_redis_holds, skip_unreadable, take_back, write_through_log
from .lookups import answered
from .model import STATES, Endpoint, Health, Secret, with_health
from .sealing import Sealer, seal
from .signing import new_secret
from .ssrf import Resolver, UnsafeUrl, UrlPolicy

__all__ = ["Endpoint", "EndpointDirectory", "EndpointStore", "Health", "with_health"]

ROTATION_OVERLAP_MS = 24 * 3600 * 1000
MAX_PREVIOUS_SECRETS = 2  # a third rotation within 24 h ends the oldest previous secret's overlap early
# A tenant's endpoints: each one that fails sends its members alert emails from the platform's own
# sender, so their number is bounded (Stripe allows 16 per account).
MAX_ENDPOINTS_PER_TENANT = 50
CHANGE_ATTEMPTS = 10
# A create's reserved place outlives its slowest finish (the operator log's write, up to its timeout
# plus 5 s); the place of a create that died before finishing is free again after it.
RESERVATION_MS = int((LOG_TIMEOUT_S + 15) * 1000)
log = logging.getLogger("streams.endpoints")


def new_endpoint_id() -> str:
    return "ep_" + uuid.uuid4().hex[:20]


# An endpoint is one record of the operator log and one Redis hash read for every event: its size is bounded,
# so that a create is refused with why (422) rather than by the log's record limit (a 503 on every try).
MAX_URL_LENGTH = 2048
MAX_EVENT_TYPES = 100
_EVENT_TYPE = re.compile(EVENT_TYPE_PATTERN)


def check_event_types(event_types: list[str]) -> tuple[str, ...]:
    """Each one an event type a send can carry (`send.EVENT_TYPE_PATTERN`), or '*' for all: an endpoint
    subscribed to a name no event can have would silently receive nothing."""
    if not event_types or len(event_types) > MAX_EVENT_TYPES:
        raise ConfigError(f"event_types must list 1 to {MAX_EVENT_TYPES} event types (or '*')")
    for i, t in enumerate(event_types):
        if not isinstance(t, str) or (t != "*" and not _EVENT_TYPE.fullmatch(t)):
            raise ConfigError(f"event_types[{i}] is not an event type: 1 to 128 of A-Z a-z 0-9 _ . : - (or '*')")
    return tuple(dict.fromkeys(event_types))


class _LookupNeeded(Exception):
    """The URL check reached its lookup (raised by the resolver `url_resolver` gives it to find out)."""


class EndpointStore:
    """Endpoints in Redis (per tenant), written through the operator log."""

    def __init__(self, client: redis.Redis, namespace: str, oplog: OperatorLog | None, policy: UrlPolicy,
                 resolve: Resolver, sealer: Sealer | None = None):
        """With `sealer`, new signing secrets are stored sealed (`sealing.py`)."""
        self.client, self.keys, self.oplog = client, RedisKeys(namespace), oplog
        self.sealer = sealer
        self.policy, self.resolve = policy, resolve
        self._reserve = client.register_script(load_script(__package__, "reserve_endpoint.lua"))
        self._save_reserved = client.register_script(load_script(__package__, "save_reserved_endpoint.lua"))
        self._set_if_unchanged = client.register_script(SET_FIELD_IF_UNCHANGED)

    def _check_url(self, url: str, resolve: Resolver | None = None) -> str:
        if len(url) > MAX_URL_LENGTH:
            raise ConfigError(f"url: at most {MAX_URL_LENGTH} characters")
        try:
            self.policy.check(url, resolve or self.resolve)
        except UnsafeUrl as exc:
            raise ConfigError(f"url: {exc}") from None
        return url

    async def url_resolver(self, url: str) -> Resolver:
        """For a request served on an event loop: the URL's host looked up there, before `create` or `update`
        runs on one of the API's threads with the answer (`resolve=`), so that no thread, of the few every
        tenant's requests share, waits up to 5 s for a tenant's silent name server. A resolver without an
        awaitable form (`addresses`) is left to the check itself, as is a URL the check refuses or passes without
        a lookup (its scheme, credentials, an address, an allowed host): no name server is asked for it."""
        lookup = getattr(self.resolve, "addresses", None)
        if lookup is None:
            return self.resolve
        host = ""

        def asked(name: str) -> list[str]:
            nonlocal host
            host = name
            raise _LookupNeeded

        try:
            self.policy.check(url, asked)
        except (UnsafeUrl, _LookupNeeded):
            pass
        if not host:
            return self.resolve
        try:
            addresses = await lookup(host)
        except (OSError, UnicodeError):  # TimeoutError and LookupFailed are OSErrors: it does not resolve
            addresses = None
        return answered(host, addresses)

    def _save(self, ep: Endpoint, expected: bytes) -> bool:
        """The operator log first, then Redis, only if the stored record is still exactly `expected` (False:
        someone changed it meanwhile); then the log ends with what Redis holds (`write_through_log`: a write Redis
        refused is taken back out of the log, and a look after a write that succeeded failing fails nothing)."""
        def write() -> bool:
            with store_errors("saving an endpoint"):
                return bool(self._set_if_unchanged(keys=[self.keys.endpoints(ep.tenant)],
                                                   args=[ep.id, expected, orjson.dumps(ep.to_doc())]))

        return write_through_log(self.oplog, f"endpoint/{ep.id}", ep.to_doc(), write,
                                 partial(self._raw, ep.tenant, ep.id), kept_if_unknown=orjson.loads(expected))

    def _change(self, tenant: str, endpoint_id: str, change: Callable[[Endpoint], Endpoint]) -> Endpoint | None:
        """Read, change and write back an endpoint, compare-and-set: a change written meanwhile by another
        request or process (the tenant's PATCH, a rotation, the worker disabling it after a 410) is read
        again and kept, never overwritten with the older record. None: no such endpoint."""
        for _ in range(CHANGE_ATTEMPTS):
            raw = self._raw(tenant, endpoint_id)
            if raw is None:
                return None
            current = Endpoint.from_doc(orjson.loads(raw))
            changed = change(current)
            if changed == current:  # nothing to write is a success too: the log still gets what Redis holds
                self._log_what_redis_holds(tenant, endpoint_id, after_success=True)
                return changed
            if self._save(changed, raw):
                return changed
        raise StoreUnavailable(f"endpoint {endpoint_id} kept changing under this change ({CHANGE_ATTEMPTS} attempts)")

    def _log_what_redis_holds(self, tenant: str, endpoint_id: str, after_success: bool = False) -> None:
        """Every change ends by logging what Redis holds (`log_what_redis_holds`): a concurrent change's
        stale put-back, or a deletion racing two changes, never stays the log's last word."""
        if self.oplog is not None:
            log_what_redis_holds(self.oplog, f"endpoint/{endpoint_id}", lambda: self._raw(tenant, endpoint_id),
                                 after_success)

    def _raw(self, tenant: str, endpoint_id: str) -> bytes | None:
        with store_errors("reading an endpoint"):
            return self.client.hget(self.keys.endpoints(tenant), endpoint_id)

    def _save_new(self, ep: Endpoint, reservations: str) -> None:
        """The operator log first, then Redis, which gives back the endpoint's reserved place in the
        same step. A Redis write that fails takes the endpoint back out of the log."""
        try:
            if self.oplog is not None:
                self.oplog.put(f"endpoint/{ep.id}", ep.to_doc())
            with store_errors("saving an endpoint"):
                self._save_reserved(keys=[self.keys.endpoints(ep.tenant), reservations],
                                    args=[ep.id, orjson.dumps(ep.to_doc())])
        except (StoreUnavailable, PublishOutcomeUnknown):  # (a log write refused outright holds nothing)
            # The caller is told the create failed (its secret is never shown): the endpoint must exist nowhere.
            # Redis may have saved it before its answer was lost: it is removed, then the log gets what Redis holds.
            try:
                with store_errors("removing a failed create"):
                    self.client.hdel(self.keys.endpoints(ep.tenant), ep.id)
            except StoreUnavailable as exc:
                log.warning("endpoint %s of tenant %s: its create failed, and Redis, which may have saved it, could "
                            "not be asked to remove it (%s)", ep.id, ep.tenant, exc)
            if self.oplog is not None:
                take_back(self.oplog, f"endpoint/{ep.id}", None, partial(self._raw, ep.tenant, ep.id))
            raise

    def create(self, tenant: str, url: str, event_types: list[str], description: str = "",
               enabled: bool = True, resolve: Resolver | None = None) -> tuple[Endpoint, str]:
        """A new endpoint and its signing secret (shown once). Its place within the tenant's bound is
        reserved first, in one Redis step with the count, so concurrent creates cannot pass the bound."""
        secret, endpoint_id = new_secret(), new_endpoint_id()
        ep = Endpoint(endpoint_id, tenant, self._check_url(url, resolve), check_event_types(event_types),
                      description[:500], enabled, secrets=(Secret(seal(secret, endpoint_id, self.sealer)),),
                      created_at_ms=int(time.time() * 1000))
        reservations = self.keys.endpoint_reservations(tenant)
        with store_errors("reserving an endpoint's place"):
            reserved = self._reserve(keys=[self.keys.endpoints(tenant), reservations],
                                     args=[ep.id, RESERVATION_MS, MAX_ENDPOINTS_PER_TENANT])
        if not reserved:
            raise ConfigError(f"a tenant may have at most {MAX_ENDPOINTS_PER_TENANT} webhook endpoints; "
                              "delete one first")
        try:
            self._save_new(ep, reservations)
        except BaseException:
            try:
                self.client.zrem(reservations, ep.id)
            except redis.RedisError:
                pass  # the reservation lapses at its deadline
            raise
        return ep, secret

    def get(self, tenant: str, endpoint_id: str) -> Endpoint | None:
        with store_errors("reading an endpoint"):
            raw = self.client.hget(self.keys.endpoints(tenant), endpoint_id)
        return Endpoint.from_doc(orjson.loads(raw)) if raw else None

    def all(self, tenant: str) -> list[Endpoint]:
        with store_errors("listing endpoints"):
            raw = self.client.hgetall(self.keys.endpoints(tenant))
        return sorted((Endpoint.from_doc(orjson.loads(v)) for v in raw.values()), key=lambda e: e.created_at_ms)

    def tenants(self) -> list[str]:
        """Every tenant with an endpoint, as Redis holds them: not as a view of the operator log has read them so
        far (a tenant's first endpoint, created a moment ago, may not be in it yet). A SCAN of the whole keyspace:
        for an operator's command (a re-seal), never a request's path."""
        prefix, suffix = self.keys.endpoints("\0").split("\0")
        pattern = f"{_glob_escape(prefix)}*{_glob_escape(suffix)}"
        with store_errors("listing the tenants with endpoints"):
            keys = self.client.scan_iter(match=pattern, count=10_000, _type="hash")
            return sorted({key.decode("utf-8", "replace")[len(prefix):-len(suffix)] for key in keys})

    def subscribers(self, tenant: str, event_type: str) -> list[Endpoint]:
        """The endpoints a new event of this type goes to: enabled by their tenant and subscribed. One disabled by a
        410 Gone is among them: its deliveries are recorded as skipped (replayable once it is reactivated), not
        left out without a trace as those of an endpoint its tenant turned off are."""
        return [e for e in self.all(tenant) if e.enabled and e.subscribes(event_type)]

    def update(self, tenant: str, endpoint_id: str, *, url: str | None = None, description: str | None = None,
               event_types: list[str] | None = None, enabled: bool | None = None,
               resolve: Resolver | None = None) -> Endpoint | None:
        if self.get(tenant, endpoint_id) is None:  # ownership first: a URL check answers nobody else's ids
            return None
        changes: dict[str, Any] = {}
        if url is not None:
            changes["url"] = self._check_url(url, resolve)
        if description is not None:
            changes["description"] = description[:500]
        if event_types is not None:
            changes["event_types"] = check_event_types(event_types)
        if enabled is not None:
            changes["enabled"] = enabled
        return self._change(tenant, endpoint_id, lambda ep: replace(ep, **changes))

    def delete(self, tenant: str, endpoint_id: str) -> bool:
        if self._raw(tenant, endpoint_id) is None:
            return False

        def write() -> bool:
            with store_errors("deleting an endpoint"):
                self.client.hdel(self.keys.endpoints(tenant), endpoint_id)
            return True

        # Taken back while Redis cannot say whether it deleted it, the log keeps the tombstone: the tenant, answered
        # 503, deletes it again and finds nothing (404, nothing logged), and a log keeping the endpoint would bring
        # it back, delivered to, at the next rebuild of Redis.
        return write_through_log(self.oplog, f"endpoint/{endpoint_id}", None, write,
                                 partial(self._raw, tenant, endpoint_id), kept_if_unknown=None, conditional=False)

    def rotate_secret(self, tenant: str, endpoint_id: str, now_ms: int | None = None) -> str | None:
        """A new current secret; the previous one stays valid 24 h (both sign meanwhile). At most
        MAX_PREVIOUS_SECRETS previous ones are kept: every delivery is signed with each valid secret
        (an HMAC over the whole body each), so rotating again and again must not multiply that work."""
        now = now_ms or int(time.time() * 1000)
        secret = new_secret()

        def rotated(ep: Endpoint) -> Endpoint:
            kept = [s if s.expires_at_ms is not None else Secret(s.value, now + ROTATION_OVERLAP_MS)
                    for s in ep.secrets if s.expires_at_ms is None or s.expires_at_ms > now][:MAX_PREVIOUS_SECRETS]
            return replace(ep, secrets=(Secret(seal(secret, ep.id, self.sealer)), *kept))

        return None if self._change(tenant, endpoint_id, rotated) is None else secret

    def set_state(self, tenant: str, endpoint_id: str, state: str, reason: str = "") -> Endpoint | None:
        """Health changes: `disabled` after a 410, `degraded` after repeated failures, `active` again on
        reactivation."""
        if state not in STATES:
            raise ConfigError(f"unknown endpoint state {state!r} (states: {', '.join(STATES)})")
        return self._change(tenant, endpoint_id, lambda ep: replace(ep, state=state, state_reason=reason))

    def reseal(self, tenant: str) -> int:
        """Every secret of the tenant's endpoints sealed under the first key (those stored in the clear, or
        under an older key, included); how many endpoints changed. UnsealError: a secret no key listed opens."""
        return sum(self.resealing(tenant))

    def resealing(self, tenant: str) -> Iterator[bool]:
        """`reseal`, one endpoint at a time: whether each changed, as it is written (a caller that meets an
        error part-way knows what was already re-sealed)."""
        assert self.sealer is not None, "re-sealing needs WEBHOOK_SECRET_KEYS"
        sealer = self.sealer
        now = int(time.time() * 1000)

        def resealed(ep: Endpoint) -> Endpoint:  # expired secrets, which never sign again, are dropped
            return replace(ep, secrets=tuple(replace(s, value=sealer.reseal(s.value, ep.id)) for s in ep.secrets
                                             if s.expires_at_ms is None or s.expires_at_ms > now))

        for ep in self.all(tenant):
            before = ep.secrets
            after = self._change(tenant, ep.id, resealed)
            yield after is not None and after.secrets != before

    def disable_gone(self, tenant: str, endpoint_id: str, url: str) -> Endpoint | None:
        """Disabled because `url` answered 410 Gone, unless the endpoint has another URL by now (the tenant
        moved it while that delivery was on its way: the answer speaks for the old URL only)."""
        reason = "the receiver answered 410 Gone"
        current = self.get(tenant, endpoint_id)
        if current is None or current.url != url or current.state == "disabled":
            # Nothing to change: answered from one Redis read, without the log write a change ends with (the
            # worker asks on its poll thread, once for each of the endpoint's deliveries that were in flight).
            return current
        return self._change(tenant, endpoint_id, lambda ep: replace(ep, state="disabled", state_reason=reason)
                            if ep.url == url else ep)


class EndpointViewBehind(StackError):
    """A process's endpoint view could not catch up with the topics it follows in the time it was given."""


@dataclass
class EndpointDirectory:
    """Every endpoint and every project's members, as the operator log says now, and every
    endpoint's health, as `notif.endpoint.state` says now. Followers (webhook workers, ingest, the
    endpoint-health app) read both from their start, so a change (a new URL, a rotated secret, a
    degraded endpoint) reaches them within a poll. Reads from other threads see a consistent
    snapshot (the dicts are replaced, never changed in place)."""

    bootstrap: str
    topic: str                       # the operator log
    state_topic: str | None = None   # endpoint health; None: not followed
    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    health: dict[str, Health] = field(default_factory=dict)
    members: dict[str, tuple[str, ...]] = field(default_factory=dict)
    caught_up: bool = False
    # Endpoints deleted in the last `remember_deleted_s` (id -> when this view saw it, monotonic), for the
    # endpoint-health app, which removes their rows; 0: not kept (every other follower).
    remember_deleted_s: float = 0.0
    deleted: dict[str, float] = field(default_factory=dict)
    _consumer: Consumer | None = None
    _ends: dict[str, int] = field(default_factory=dict)       # each topic's end when we started
    _polled: threading.Condition = field(default_factory=threading.Condition)
    _applied: dict[str, int] = field(default_factory=dict)

    @property
    def topics(self) -> tuple[str, ...]:
        return (self.topic,) if self.state_topic is None else (self.topic, self.state_topic)

    def start(self) -> None:
        self._consumer = Consumer(client_config(self.bootstrap, quiet=True, settings={
            "group.id": f"endpoint-directory-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False}))
        self._consumer.assign([TopicPartition(t, 0, OFFSET_BEGINNING) for t in self.topics])

    def _learn_ends(self) -> None:
        """The end offsets to catch up to (asked again on the next poll while the broker cannot say)."""
        assert self._consumer is not None
        for topic in self.topics:
            if topic in self._ends:
                continue
            try:
                low, high = self._consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=1, cached=False)
            except Exception as exc:  # noqa: BLE001 - e.g. a leader not elected yet: ask again next poll
                log.debug("%s end not known yet: %s", topic, exc)
                continue
            self._ends[topic] = high if high > low else 0

    def _check_caught_up(self) -> None:
        self.caught_up = len(self._ends) == len(self.topics) and all(
            end == 0 or self._applied.get(t, -1) >= end for t, end in self._ends.items())

    def poll(self) -> None:
        """Apply what the topics have gained since the last poll (never blocks long)."""
        if self._consumer is None:
            return
        if not self.caught_up:
            self._learn_ends()
        batch = self._consumer.consume(num_messages=1000, timeout=0)
        if not batch:
            self._mark_applied()  # a position may move past control records alone
            if not self.caught_up:
                self._check_caught_up()
            return
        endpoints, health, members = dict(self.endpoints), dict(self.health), dict(self.members)
        for m in batch:
            if m.error():
                continue
            try:
                self._apply(m.topic(), (m.key() or b"").decode(), m.value(), endpoints, health, members)
            except (ValueError, TypeError, KeyError, AttributeError) as exc:  # orjson's errors are ValueErrors
                # One bad record must not cost the rest of the batch, nor stop every follower (workers
                # poll on their own thread).
                skip_unreadable(m.topic(), m.offset(), m.key() or b"", type(exc).__name__)
        self.endpoints, self.health, self.members = endpoints, health, members
        self._mark_applied()
        if not self.caught_up:
            self._check_caught_up()

    def _apply(self, topic: str, key: str, value: bytes | None, endpoints: dict[str, Endpoint],
               health: dict[str, Health], members: dict[str, tuple[str, ...]]) -> None:
        """One record into the new dicts (a None value deletes the key); raises when it cannot be read."""
        if topic == self.state_topic:
            if value is None:
                health.pop(key, None)
            else:
                doc = orjson.loads(value)
                health[key] = Health(str(doc.get("state", "active")), str(doc.get("reason", "")),
                                     int(doc.get("since_ms", 0)))
        elif key.startswith("endpoint/"):
            endpoint_id = key.removeprefix("endpoint/")
            if value is None:
                endpoints.pop(endpoint_id, None)
                if self.remember_deleted_s:
                    self.deleted[endpoint_id] = time.monotonic()
            else:
                endpoints[endpoint_id] = Endpoint.from_doc(orjson.loads(value))
                self.deleted.pop(endpoint_id, None)
        elif key.startswith("members/"):
            members[key.removeprefix("members/")] = tuple(orjson.loads(value)["emails"]) if value else ()

    def recently_deleted(self) -> list[str]:
        """The endpoints deleted within `remember_deleted_s` (those deleted earlier forgotten here)."""
        now = time.monotonic()
        for endpoint_id in [e for e, seen in self.deleted.items() if now - seen > self.remember_deleted_s]:
            del self.deleted[endpoint_id]
        return list(self.deleted)

    def _mark_applied(self) -> None:
        """Each topic's offset the view's dicts now hold everything before (read after they were replaced)."""
        assert self._consumer is not None
        positions = self._consumer.position([TopicPartition(t, 0) for t in self.topics])
        with self._polled:
            self._applied = {tp.topic: tp.offset for tp in positions}
            self._polled.notify_all()

    def sync(self, timeout_s: float) -> bool:
        """Wait (at most timeout_s) until this view holds everything the topics hold now, while another
        thread polls it. Two processes following the same topics each see a change a moment apart;
        this makes a process that acts on a request see what another process already showed the
        client (an endpoint it showed as reactivated gets the deliveries sent right after). False:
        not within timeout_s (the view is used as it is, as before)."""
        assert self._consumer is not None
        deadline = time.monotonic() + timeout_s
        try:
            ends = {t: watermarks(self._consumer, TopicPartition(t, 0), max(0.1, deadline - time.monotonic()))
                    for t in self.topics}
        except Exception as exc:  # noqa: BLE001 - the view stays usable; the broker's trouble shows elsewhere
            log.warning("endpoint view not brought up to date: %s", exc)
            return False
        with self._polled:
            while True:
                if all(high <= low or self._applied.get(t, -1) >= high for t, (low, high) in ends.items()):
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._polled.wait(remaining)

    def catch_up(self, timeout_s: float = 10.0) -> None:
        """Poll until the view holds everything the topics held when it started (one-shot readers)."""
        deadline = time.monotonic() + timeout_s
        self.poll()
        while not self.caught_up:
            if time.monotonic() > deadline:
                raise StackError(f"reading {', '.join(self.topics)} did not catch up within {timeout_s:.0f} s")
            time.sleep(0.05)
            self.poll()

    def find(self, endpoint_id: str, sync_s: float) -> Endpoint | None:
        """An endpoint by its id alone, as configured (its tenant never changes). One this view has not read yet
        (created a moment ago through another process) is looked for again once the view holds what the topics hold
        now, which takes another thread polling it. None: no such endpoint. EndpointViewBehind: not caught up within
        sync_s, so its absence says nothing."""
        found = self.endpoints.get(endpoint_id)
        if found is None:
            if not self.sync(sync_s):
                raise EndpointViewBehind(f"the endpoint view did not catch up with {', '.join(self.topics)} "
                                         f"within {sync_s:.0f} s")
            found = self.endpoints.get(endpoint_id)
        return found

    def get(self, endpoint_id: str) -> Endpoint | None:
        """The endpoint, its state combining its configuration (`disabled` after a 410) and its health."""
        ep = self.endpoints.get(endpoint_id)
        return None if ep is None else with_health(ep, self.health.get(endpoint_id))

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()


def _glob_escape(text: str) -> str:
    """`text` matched literally in a Redis SCAN pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)
