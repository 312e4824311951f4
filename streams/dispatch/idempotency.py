"""`processed_jobs` in Redis: a send is delivered at most once, whoever handles it.

Per send id the key holds nothing (free), `inflight:<idempotency key>` (a provider request carrying
it was sent or is being sent), `delivered`, `reconcile` (its outcome is unknown at a provider
that does not honour idempotency keys: never sent again by dispatch itself), or `tried:<n>`: attempt n
failed definitely and the copy that carries the send on (its retry copy, or its dead letter) is
acknowledged by the broker; free to claim, but a copy of the send for attempt n or earlier, read again
after a crash or a rebalance, is stale (so one send never runs two retry chains). The mark is written
only once that copy is durable: a worker that dies before leaves the send free, and its message, read
again, is sent again rather than lost.
Claiming a request records its exact body under its
idempotency key for as long as the provider remembers keys (24 h), plus a short lease held by the
sender and kept alive by it (`refresh`, every few seconds, while the request is in flight): the
lease lapses within LEASE_S of its holder dying, never while a live holder may still be sending.
When a request's outcome is unknown (the worker died, or the answer was lost), whoever meets the
send later takes the lapsed lease and re-sends *that same body with that same key*, so the provider
answers with its stored response instead of delivering again. A definite failure releases the
claim, except when another worker holds the lease, the record names another owner, or the record is
marked `unknown` (taken over for a re-send, or an outcome was unknown): the provider may then hold a
copy (`release.lua`). Every key of a claim carries the tenant's hash tag (one Redis Cluster slot).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Literal

import orjson
import redis

from ..errors import StateLost, StoreUnavailable
from ..names import RedisKeys
from ..redis_client import is_cluster, load_script, ping_every_master, store_errors

DELIVERED_TTL_S = 7 * 24 * 3600     # as long as lane topics keep payloads: any replay finds the mark
LEASE_S = 10.0                      # a claim's lease lapses this long after its holder stops refreshing it
REFRESH_EVERY_S = 2.0               # how often a live holder refreshes the leases of its requests
# A request's record lives inside its provider's idempotency window (ProviderSpec.record_ttl_ms); this one, inside
# a 24 h window by an hour, where none is given.
RECORD_TTL_MS = 23 * 3600 * 1000
CLAIM_TTL_MS = DELIVERED_TTL_S * 1000  # a claim outlives its record: see take_over
# A `tried:<n>` mark keeps every copy of a send's earlier attempts stale for as long as one can be read (a lane
# keeps payloads 7 days; a retry copy parked near its send's max age comes back up to 2 days later), whatever
# the claims live: a webhook delivery skipped for good, whose mark lapsed, was sent by its copy read again.
TRIED_TTL_MS = DELIVERED_TTL_S * 1000
RECORD_GONE: Literal["gone"] = "gone"


def idempotency_key(send_ids: list[str]) -> str:
    """The provider Idempotency-Key: the send id for one send, a digest of the sorted ids for a batch."""
    if len(send_ids) == 1:
        return f"send-{send_ids[0]}"
    return "batch-" + hashlib.sha256(",".join(sorted(send_ids)).encode()).hexdigest()[:40]


@dataclass(frozen=True)
class Claim:
    """One provider request to claim: its sends, under its idempotency key, with its exact body."""

    tenant: str
    key: str
    send_ids: tuple[str, ...]
    owner: str
    path: str
    body: bytes = field(repr=False)  # the provider request: recipients, subject, text
    provider: str = ""  # "" : the channel's first provider
    attempts: dict[str, int] = field(default_factory=dict)  # sends above their first attempt: send id -> attempt
    account: str = ""  # the digest of the key it goes under (ProviderCredentials.account)
    record_ttl_ms: int = RECORD_TTL_MS  # how long its body is kept to be re-sent (inside the provider's window)


@dataclass(frozen=True)
class StoredRequest:
    key: str
    path: str
    body: bytes = field(repr=False)  # the provider request: recipients, subject, text
    tenant: str
    send_ids: tuple[str, ...]
    provider: str = ""  # the provider it went to: a recovered request goes to the same one
    # Each send's live attempt (above its first): a copy for an earlier one is stale (claim.lua, note_attempts.lua).
    attempts: dict[str, int] = field(default_factory=dict)
    account: str = ""  # the digest of the key it went under ("" : not recorded, by an older version)


NO_EPOCH_MARKER = -1  # claim.lua's answer in a slot without its epoch marker


@dataclass(frozen=True)
class SendClaim:
    """What processed_jobs says of one send now: its state (None: free), whether a request claiming it is being
    sent (its lease held), and while a request of several sends claims it and keeps their body (a copy of any of
    them met later re-sends that body whole), the other sends it carries and how long its record is kept yet."""

    state: str | None
    in_flight: bool = False
    others: tuple[str, ...] = ()
    kept_s: int = 0


def read_send_claim(client: redis.Redis, keys: RedisKeys, tenant: str, send_id: str) -> SendClaim:
    """The send's claim, for an operator's replay (not on the hot path). The state is read again after the
    request's record: a record settled in between (deleted as its sends are marked) shows in the new state."""
    with store_errors("reading a send's claim"):
        state = client.get(keys.processed(tenant, send_id))
        if not state or not state.startswith(b"inflight:"):
            return SendClaim(state.decode() if state else None)
        key = state[len(b"inflight:"):].decode()
        pipe = client.pipeline(transaction=False)
        pipe.hget(keys.request(tenant, key), "ids")
        pipe.ttl(keys.request(tenant, key))
        pipe.exists(keys.lease(tenant, key))
        pipe.get(keys.processed(tenant, send_id))
        ids, kept_s, leased, state = pipe.execute()
    others = tuple(s for s in orjson.loads(ids) if s != send_id) if ids else ()
    return SendClaim(state.decode() if state else None, bool(leased and ids), others,
                     max(0, kept_s) if others else 0)


class ProcessedJobs:
    def __init__(self, client: redis.Redis, namespace: str = "", lease_s: float = LEASE_S,
                 epoch_required: bool = False, claim_ttl_ms: int = CLAIM_TTL_MS):
        """`epoch_required`: every claim also reads the Redis epoch (on a Redis Cluster, the epoch's
        marker in its own slot; see `claim_many`); set where a state guard watches for lost data, as
        in every production worker. `claim_ttl_ms`: how long
        sends stay claimed; RECORD_TTL_MS where a request may be sent afresh once its record
        expired (webhooks: receivers deduplicate by the delivery's id, with no window)."""
        self.client = client
        self.keys = RedisKeys(namespace)
        self.lease_ms = int(lease_s * 1000)
        self.claim_ttl_ms = claim_ttl_ms
        self.epoch_required = epoch_required
        self._cluster = is_cluster(client)
        self._claim = client.register_script(load_script(__package__, "claim.lua"))
        self._release = client.register_script(load_script(__package__, "release.lua"))
        self._mark = client.register_script(load_script(__package__, "mark_delivered.lua"))
        self._refresh = client.register_script(load_script(__package__, "refresh.lua"))
        self._drop_lease = client.register_script(load_script(__package__, "drop_lease.lua"))
        self._take_over = client.register_script(load_script(__package__, "take_over.lua"))
        self._mark_tried = client.register_script(load_script(__package__, "mark_tried.lua"))
        self._note_attempts = client.register_script(load_script(__package__, "note_attempts.lua"))
        self._restore_mark = client.register_script(load_script(__package__, "restore_mark.lua"))

    def _request_keys(self, tenant: str, key: str, send_ids) -> list[str]:
        k = self.keys
        return [k.lease(tenant, key), k.request(tenant, key)] + [k.processed(tenant, s) for s in send_ids]

    def ping(self) -> None:
        """Whether Redis answers (StoreUnavailable if not): on a Redis Cluster, every master (a PING goes to
        one node, which could answer while the master holding some tenants' keys is down)."""
        with store_errors("asking Redis whether it answers"):
            ping_every_master(self.client)

    def status(self, tenant: str, send_ids: list[str]) -> list[str | None]:
        """Per send: None (free), 'delivered', 'inflight:<key>', 'reconcile' or 'tried:<n>'."""
        with store_errors("reading processed_jobs"):
            values = self.client.mget([self.keys.processed(tenant, s) for s in send_ids])
        return [v.decode() if v else None for v in values]

    def status_many(self, groups: list[tuple[str, list[str]]]) -> list[list[str | None]]:
        """`status` for several (tenant, send ids) groups in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        for tenant, send_ids in groups:
            pipe.mget([self.keys.processed(tenant, s) for s in send_ids])
        with store_errors("reading processed_jobs"):
            replies = pipe.execute()
        return [[v.decode() if v else None for v in values] for values in replies]

    def claim_many(self, claims: list[Claim]) -> list[list[int]]:
        """`claim` for several requests in one round trip (each all or none, as `claim`).

        With `epoch_required`, each claim first reads the epoch (on a Redis Cluster, its slot's
        marker of it), in the same script: without it the data was lost (a delivered send would
        look free), so nothing is claimed and StateLost is raised, without waiting for the state
        guard's next look. Claims the same round trip made on a cluster's shards that kept their
        data are released again, so that the whole round goes back to its queues."""
        pipe = self.client.pipeline(transaction=False)
        for c in claims:
            self._claim(keys=self._claim_keys(c), args=self._claim_args(c), client=pipe)
        with store_errors("claiming sends"):
            replies = pipe.execute()
        lost_in = [c.tenant for c, r in zip(claims, replies, strict=True) if r == NO_EPOCH_MARKER]
        if lost_in:
            lost = f"Redis lost the data of tenant {lost_in[0]}'s slot (no epoch marker there)"
            try:
                self.release_unsent([c for c, r in zip(claims, replies, strict=True) if r == []])
            except StoreUnavailable as exc:
                raise StateLost(f"{lost}; claims made in other slots could not all be released") from exc
            raise StateLost(f"{lost}; nothing was claimed there")
        return [[int(i) for i in busy] for busy in replies]

    def _claim_keys(self, c: Claim) -> list[str]:
        marker = self.keys.tenant_epoch_marker(c.tenant) if self._cluster else self.keys.epoch
        return self._request_keys(c.tenant, c.key, c.send_ids) + [marker]

    def release_unsent(self, claims: list[Claim]) -> None:
        """Claims whose request was never sent (one whose claim's answer was lost may not have been made at
        all): each send back to what it was before, free or, on its attempt n+1, `tried:<n>` (release.lua;
        another worker's claim under the same key is left alone)."""
        if not claims:
            return
        pipe = self.client.pipeline(transaction=False)
        for c in claims:
            earlier = orjson.dumps([c.attempts.get(s, 1) - 1 for s in c.send_ids]).decode() if c.attempts else ""
            self._release(keys=self._request_keys(c.tenant, c.key, c.send_ids),
                          args=[f"inflight:{c.key}", c.owner, earlier, TRIED_TTL_MS], client=pipe)
        with store_errors("releasing claims"):
            pipe.execute()

    def _claim_args(self, c: Claim) -> list:
        return [f"inflight:{c.key}", c.owner, self.lease_ms, c.record_ttl_ms, c.path, c.body, c.tenant,
                orjson.dumps(sorted(c.send_ids)), c.provider, self.claim_ttl_ms, "1" if self.epoch_required else "0",
                orjson.dumps(c.attempts) if c.attempts else "", c.account,
                orjson.dumps([c.attempts.get(s, 1) for s in c.send_ids]) if c.attempts else ""]  # '': all first

    def claim(self, send_ids: list[str], key: str, owner: str, path: str, body: bytes,
              tenant: str, provider: str = "") -> list[int]:
        """Claim all or none; returns the positions of sends that are not free (empty: claimed)."""
        return self.claim_many([Claim(tenant, key, tuple(send_ids), owner, path, body, provider)])[0]

    def take_over(self, tenant: str, key: str, owner: str,
                  send_ids: list[str] | tuple[str, ...]) -> StoredRequest | Literal["gone"] | None:
        """Take the lease of an in-flight request whose sender is gone; None while it is held (or
        when it was settled since `send_ids`, the sends met, were read: read them again).
        RECORD_GONE when its record expired while those sends stayed claimed: its outcome has been
        unknown for longer than the provider keeps idempotency keys, so neither a re-send nor a
        fresh send is safe (either could deliver twice)."""
        with store_errors("taking over a request"):
            reply = self._take_over(keys=self._request_keys(tenant, key, send_ids),
                                    args=[owner, self.lease_ms, f"inflight:{key}"])
        if reply == 0:
            return RECORD_GONE
        if not reply:
            return None
        rec = dict(zip(reply[::2], reply[1::2], strict=True))
        ids = tuple(orjson.loads(rec[b"ids"]))
        attempts = orjson.loads(rec[b"attempts"]) if rec.get(b"attempts") else {}
        return StoredRequest(key, rec[b"path"].decode(), rec[b"body"], rec[b"tenant"].decode(), ids,
                             rec.get(b"provider", b"").decode(), {str(s): int(n) for s, n in attempts.items()},
                             rec.get(b"account", b"").decode())

    def mark_delivered(self, tenant: str, send_ids: list[str] | tuple[str, ...], key: str) -> None:
        """Every send of the request `delivered`, and its lease and record gone, in one call."""
        with store_errors("marking sends delivered"):
            self._mark(keys=self._request_keys(tenant, key, send_ids), args=[DELIVERED_TTL_S, "delivered"])

    def mark_delivered_many(self, requests: list[tuple[str, tuple[str, ...], str]]) -> None:
        """`mark_delivered` for several (tenant, send ids, request key) in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        for tenant, send_ids, key in requests:
            self._mark(keys=self._request_keys(tenant, key, send_ids), args=[DELIVERED_TTL_S, "delivered"], client=pipe)
        with store_errors("marking sends delivered"):
            pipe.execute()

    def mark_tried_many(self, tried: list[tuple[str, str, int]]) -> None:
        """(tenant, send id, attempt) whose failed attempt's copy is acknowledged: `tried:<attempt>`, unless the
        key says more already (mark_tried.lua). One script per tenant (one Redis Cluster slot), one round trip."""
        if not tried:
            return
        by_tenant: dict[str, dict[str, int]] = {}
        for tenant, send_id, attempt in tried:
            mine = by_tenant.setdefault(tenant, {})
            mine[send_id] = max(attempt, mine.get(send_id, 0))
        pipe = self.client.pipeline(transaction=False)
        for tenant, attempts in by_tenant.items():
            self._mark_tried(keys=[self.keys.processed(tenant, s) for s in attempts],
                             args=[*attempts.values(), TRIED_TTL_MS], client=pipe)
        with store_errors("marking failed attempts"):
            pipe.execute()

    def note_attempts(self, noted: list[tuple[str, str, str, int]]) -> None:
        """(tenant, request key, send id, live attempt): the request was kept claimed after a failure, and the copy
        carrying the send on to that attempt (or its dead letter) is acknowledged (note_attempts.lua). One round
        trip."""
        by_request: dict[tuple[str, str], dict[str, int]] = {}
        for tenant, key, send_id, attempt in noted:
            mine = by_request.setdefault((tenant, key), {})
            mine[send_id] = max(attempt, mine.get(send_id, 0))
        if not by_request:
            return
        pipe = self.client.pipeline(transaction=False)
        for (tenant, key), attempts in by_request.items():
            self._note_attempts(keys=[self.keys.request(tenant, key)], args=[orjson.dumps(attempts)], client=pipe)
        with store_errors("noting a kept request's live attempts"):
            pipe.execute()

    def restore_mark(self, tenant: str, send_id: str, mark: str, ttl_s: int) -> bool:
        """`streams state recover`: `reconcile` or `tried:<n>` again, unless the key says more (restore_mark.lua)."""
        with store_errors("restoring a send's mark"):
            return bool(self._restore_mark(keys=[self.keys.processed(tenant, send_id)], args=[mark, ttl_s]))

    def mark_reconcile(self, tenant: str, send_ids: list[str] | tuple[str, ...], key: str) -> None:
        """The outcome is unknown at a provider that does not honour idempotency keys: nothing may send
        these again by itself (a re-send could deliver twice); they wait for reconciliation."""
        with store_errors("marking sends for reconciliation"):
            self._mark(keys=self._request_keys(tenant, key, send_ids), args=[DELIVERED_TTL_S, "reconcile"])

    def release(self, tenant: str, send_ids: list[str] | tuple[str, ...], key: str, owner: str,
                earlier: dict[str, int] | None = None) -> bool:
        """The provider did not accept `owner`'s request: the sends are free again, unless another
        worker holds the lease or the request was re-sent or met an unknown outcome (release.lua):
        then the sends stay claimed under the key, to be re-sent as that same request, and False says so.
        `earlier`: per send, the attempt before the one released (its copy was read from the broker, so that
        attempt's carrier is durable): the send is `tried:<n>` again rather than free."""
        attempts = orjson.dumps([(earlier or {}).get(s, 0) for s in send_ids]).decode() if earlier else ""
        with store_errors("releasing a claim"):
            return self._release(keys=self._request_keys(tenant, key, send_ids),
                                 args=[f"inflight:{key}", owner, attempts, TRIED_TTL_MS]) == 1

    def refresh(self, leases: list[tuple[str, str]], owner: str) -> None:
        """Extend the leases (tenant, request key) this holder still owns: it is alive and sending."""
        if not leases:
            return
        pipe = self.client.pipeline(transaction=False)
        for tenant, key in leases:
            self._refresh(keys=[self.keys.lease(tenant, key)], args=[owner, self.lease_ms], client=pipe)
        with store_errors("refreshing claim leases"):
            pipe.execute()

    def keep_unknown(self, tenant: str, key: str, owner: str, send_ids: list[str] | tuple[str, ...]) -> int:
        """The outcome is unknown: the request's record is marked so, and `owner` drops its lease so
        a later attempt re-sends the same request (a lease another worker took meanwhile is left to it).
        How many sends it left to reconciliation instead: with the record gone (a failover lost it), those that
        nothing settled or claimed anew, as no request can re-send them under its key (drop_lease.lua; a single
        send's fresh request too could go under another: drawn into a batch, or after the provider forgot it)."""
        with store_errors("keeping an unknown outcome"):
            answer = self._drop_lease(keys=self._request_keys(tenant, key, send_ids),
                                      args=[owner, f"inflight:{key}", DELIVERED_TTL_S])
        return max(0, -int(answer))
