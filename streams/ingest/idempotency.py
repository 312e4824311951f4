"""`Idempotency-Key` on the ingest API: per tenant, kept 24 h (from its last attempt that may have published).

The first request under a key claims it (`pending`, with a lease) and records the time of its
first use; when it is answered, the answer (status and body) is stored under the key with a hash
of the request's body. A request under the same key then gets, depending on its body and the key's
state:

- the same body, answered: the stored answer again (the same send ids), and nothing is published;
- a different body, or another route (a key used on `/v1/sends` sent to `/v1/sends/batch`): 422
  (`idempotency_key_reused`), nothing is published;
- the same key still pending (the first request is being published): 409 with Retry-After.

A request that failed with nothing published (a 4xx, a 503 without `"outcome": "unknown"`)
releases the key. A request whose outcome is unknown (a 503 with `"outcome": "unknown"`: the broker
may have written it) ends its lease instead and keeps the key's first use: the retry under the key
publishes the same send ids, so whatever the broker did write of the first attempt is sent once (a
retry with a different body under that key gets 422, as for an answered key). From then on the key
is never freed, also when a later retry fails with nothing published (it would free the first
attempt's ids); the same holds for a key taken over after a lapsed lease.

While a request is being published, the process serving it renews its lease every third of
PENDING_LEASE_S (only its own lease: each claim has a holder token), so a publish that waits on a
broker in trouble for minutes still answers duplicates with 409. If the process dies while a key
is pending, the lease lapses after PENDING_LEASE_S and the next request under the key publishes
again; its send ids are derived from (tenant, key, position, first use), so they are the same ids,
and dispatch delivers each id once. Such a retry (of a key that may have been published) is not charged
to the ingest quotas again for the sends an earlier attempt was charged for (noted on the key once its
quotas admitted it; sends that differ, a webhook event fanned out to endpoints added since, are charged in
full). Leases are timed by Redis's clock (`TIME` in the scripts): a host
whose clock runs ahead would otherwise take over a live lease, one whose clock runs behind renew
into the past.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass

import orjson
import redis

from ..names import RedisKeys
from ..redis_client import store_errors

KEPT_S = 24 * 3600
PENDING_LEASE_S = 60
MAX_KEY_LENGTH = 255

_BEGIN = """
-- KEYS[1] the key's hash; ARGV: body hash, now ms (the key's first use), lease ms, kept s, holder token, route
-- Leases are timed by Redis's clock, never the caller's: API hosts whose clocks disagree still agree
-- on whether a lease is live.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local state = redis.call('HGET', KEYS[1], 'state')
-- A key names one request on one route (keys stored before routes were kept have none: any route)
local route = redis.call('HGET', KEYS[1], 'route')
if state and route and route ~= ARGV[6] then return {'other_route', route} end
if state == 'done' then
  if redis.call('HGET', KEYS[1], 'hash') ~= ARGV[1] then return {'conflict', 0} end
  return {'done', redis.call('HGET', KEYS[1], 'status'), redis.call('HGET', KEYS[1], 'answer')}
end
if state == 'pending' then
  if redis.call('HGET', KEYS[1], 'hash') ~= ARGV[1] then return {'conflict', 0} end
  if tonumber(redis.call('HGET', KEYS[1], 'lease_until')) > now then return {'pending', 0} end
  -- taken over: whoever held it before may have published (maybe = 1 keeps first_ms from now on); also
  -- returned: the sends an earlier attempt was charged to the quotas for ('' if none was)
  redis.call('HSET', KEYS[1], 'lease_until', now + tonumber(ARGV[3]), 'holder', ARGV[5], 'maybe', 1)
  redis.call('EXPIRE', KEYS[1], ARGV[4])  -- kept a full day from this attempt too, which may publish
  return {'claimed', redis.call('HGET', KEYS[1], 'first_ms'), redis.call('HGET', KEYS[1], 'charged') or '', 1}
end
redis.call('HSET', KEYS[1], 'state', 'pending', 'hash', ARGV[1], 'first_ms', ARGV[2],
           'lease_until', now + tonumber(ARGV[3]), 'holder', ARGV[5], 'route', ARGV[6])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return {'claimed', ARGV[2], '', 0}
"""

_AS_HOLDER = """
-- KEYS[1] the key's hash; ARGV: holder token, action (renew | charged | finish | lapse | release), then the
-- action's own: renew: lease ms (from Redis's clock); charged: the digest of the sends charged to the quotas;
-- finish: status, answer, kept s; lapse and release: kept s (from now, for a key that may have been published).
-- Acts only while the key is
-- pending under this holder's claim (its lease did not lapse into another request's hands).
-- A key an earlier attempt may have published under (maybe = 1) is never freed: release lapses it.
-- 1: done; 0: no longer ours
if redis.call('HGET', KEYS[1], 'state') ~= 'pending' or redis.call('HGET', KEYS[1], 'holder') ~= ARGV[1] then
  return 0
end
if ARGV[2] == 'renew' then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('HSET', KEYS[1], 'lease_until', now + tonumber(ARGV[3]))
elseif ARGV[2] == 'charged' then
  redis.call('HSET', KEYS[1], 'charged', ARGV[3])
elseif ARGV[2] == 'finish' then
  redis.call('HSET', KEYS[1], 'state', 'done', 'status', ARGV[3], 'answer', ARGV[4])
  redis.call('EXPIRE', KEYS[1], ARGV[5])
elseif ARGV[2] == 'lapse' or redis.call('HGET', KEYS[1], 'maybe') == '1' then
  redis.call('HSET', KEYS[1], 'lease_until', 0, 'holder', '', 'maybe', 1)
  redis.call('EXPIRE', KEYS[1], ARGV[3])
else
  redis.call('DEL', KEYS[1])
end
return 1
"""


@dataclass(frozen=True)
class Claimed:
    first_ms: int   # the key's first use: the time part of its send ids
    holder: str     # this claim's token: only its holder renews, answers or frees the key
    # The sends (`sends_digest`) an earlier attempt under the key, which may have been published, was charged to
    # the quotas for ("": none): this one, publishing the same send ids, is not charged again.
    charged_before: str = ""
    # Taken over from an earlier attempt that may have published (its outcome unknown, or its process gone):
    # this attempt failing with nothing published of its own must not answer "nothing was published".
    maybe_published_before: bool = False


@dataclass(frozen=True)
class Answered:
    status: int
    body: dict


@dataclass(frozen=True)
class Conflict:
    pass


@dataclass(frozen=True)
class Pending:
    pass


@dataclass(frozen=True)
class OtherRoute:
    """The key was used on another route in the last 24 h (a key names one request on one route)."""

    route: str


def sends_digest(send_ids: list[str]) -> str:
    """The send ids a request publishes, in any order (two attempts under one key carry the same ids, unless
    the tenant's webhook endpoints changed in between)."""
    return hashlib.sha256("\n".join(sorted(send_ids)).encode()).hexdigest()


def body_hash(body: object) -> str:
    """The request's body, canonically (key order does not matter)."""
    return hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()


class IngestIdempotency:
    def __init__(self, client: redis.Redis, namespace: str = "", lease_s: float = PENDING_LEASE_S):
        self.client, self.keys = client, RedisKeys(namespace)
        self.lease_s = lease_s
        self._begin = client.register_script(_BEGIN)
        self._as_holder = client.register_script(_AS_HOLDER)

    def begin(self, tenant: str, key: str, digest: str,
              route: str) -> Claimed | Answered | Conflict | Pending | OtherRoute:
        """Claim the key for a request on `route` (e.g. "POST /v1/sends") with the body hash `digest`, or say why
        not: its answer to replay, another body or route under it, or a request still publishing under it."""
        now_ms = int(time.time() * 1000)
        holder = uuid.uuid4().hex
        with store_errors("checking an Idempotency-Key"):
            reply = self._begin(keys=[self.keys.ingest_idempotency(tenant, key)],
                                args=[digest, now_ms, int(self.lease_s * 1000), KEPT_S, holder, route])
        state = reply[0].decode() if isinstance(reply[0], bytes) else reply[0]
        if state == "other_route":
            return OtherRoute(reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1]))
        if state == "done":
            return Answered(int(reply[1]), orjson.loads(reply[2]))
        if state == "conflict":
            return Conflict()
        if state == "pending":
            return Pending()
        charged = reply[2] if len(reply) > 2 else b""
        return Claimed(int(reply[1]), holder, charged.decode() if isinstance(charged, bytes) else str(charged),
                       maybe_published_before=len(reply) > 3 and int(reply[3]) == 1)

    def renew(self, tenant: str, key: str, holder: str) -> bool:
        """Extend a pending key's lease by lease_s from now, if `holder` still holds it."""
        with store_errors("renewing an Idempotency-Key's lease"):
            return bool(self._as_holder(keys=[self.keys.ingest_idempotency(tenant, key)],
                                        args=[holder, "renew", int(self.lease_s * 1000)]))

    def charged(self, tenant: str, key: str, holder: str, digest: str) -> bool:
        """Note on the key that this claim's sends (`sends_digest`) were charged to the quotas: a retry of the
        same sends after this attempt's outcome turned out unknown is not charged again. False: the claim is no
        longer this holder's (its lease lapsed into another request's hands), nothing was noted."""
        with store_errors("noting an Idempotency-Key's charge"):
            return bool(self._as_holder(keys=[self.keys.ingest_idempotency(tenant, key)],
                                        args=[holder, "charged", digest]))

    def finish(self, tenant: str, key: str, status: int, body: dict, holder: str) -> bool:
        """Store the answer under the key, if this claim (`holder`) still holds it; False: its lease
        lapsed and another request took the key over (that request's answer is the one kept)."""
        with store_errors("storing an idempotent answer"):
            return bool(self._as_holder(keys=[self.keys.ingest_idempotency(tenant, key)],
                                        args=[holder, "finish", status, orjson.dumps(body), KEPT_S]))

    def lapse(self, tenant: str, key: str, holder: str) -> None:
        """The request may have been published: end its lease now and keep the key's first use and body,
        so the client's retry under the key publishes the same send ids (only while this claim holds it)."""
        with store_errors("ending an Idempotency-Key's lease"):
            self._as_holder(keys=[self.keys.ingest_idempotency(tenant, key)], args=[holder, "lapse", KEPT_S])

    def release(self, tenant: str, key: str, holder: str) -> None:
        """Nothing was published: the key is free for the client's retry (only while this claim holds it),
        unless an earlier attempt under it may have published: then it lapses (its first use is kept)."""
        with store_errors("releasing an Idempotency-Key"):
            self._as_holder(keys=[self.keys.ingest_idempotency(tenant, key)], args=[holder, "release", KEPT_S])
