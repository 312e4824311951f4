"""Every name the project gives to a topic, a consumer group or a Redis key, in one place. Pure code.

A namespace prefix (tests use one each; `DUAL_RAIL_TOPIC_NAMESPACE`) goes in front of every name.
Redis keys carry a hash tag (the part in braces) so that every key one Lua script touches lives
in one Redis Cluster slot: gate keys by provider, idempotency keys by tenant (a provider request
never mixes tenants).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

HASH_SLOTS = 16384  # a Redis Cluster's


def _crc16_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021 if crc & 0x8000 else crc << 1) & 0xFFFF
        table.append(crc)
    return tuple(table)


_CRC16 = _crc16_table()


def hash_slot(tag: str) -> int:
    """The Redis Cluster hash slot of a key whose hash tag is `tag` (CRC16/XMODEM modulo 16,384)."""
    crc = 0
    for byte in tag.encode():
        crc = ((crc << 8) & 0xFFFF) ^ _CRC16[((crc >> 8) ^ byte) & 0xFF]
    return crc % HASH_SLOTS


@functools.cache
def slot_tags() -> tuple[str, ...]:
    """For each Redis Cluster hash slot, the shortest decimal hash tag that lands on it."""
    tags: list[str | None] = [None] * HASH_SLOTS
    left, n = HASH_SLOTS, 0
    while left:
        slot = hash_slot(str(n))
        if tags[slot] is None:
            tags[slot], left = str(n), left - 1
        n += 1
    return tuple(t for t in tags if t is not None)


@dataclass(frozen=True)
class TopicNames:
    """Topic and consumer-group names."""

    namespace: str = ""

    def lane(self, channel: str, lane: str) -> str:
        return f"{self.namespace}notif.{channel}.{lane}"

    def retry(self, channel: str, lane: str, tier: str) -> str:
        return f"{self.namespace}notif.{channel}.{lane}.retry.{tier}"

    @property
    def dlq(self) -> str:
        return f"{self.namespace}notif.dlq"

    @property
    def outcomes(self) -> str:
        return f"{self.namespace}notif.outcomes"

    @property
    def lag(self) -> str:
        return f"{self.namespace}notif.lag"

    @property
    def webhook_attempts(self) -> str:
        """Every webhook delivery attempt, key = endpoint id (endpoint health follows it)."""
        return f"{self.namespace}notif.webhook.attempts"

    @property
    def endpoint_state(self) -> str:
        """Webhook endpoint health, key = endpoint id (compacted; written by endpoint-health)."""
        return f"{self.namespace}notif.endpoint.state"

    @property
    def webhook_skipped(self) -> str:
        """Webhook deliveries never enqueued (degraded endpoint, shed backlog), kept 7 days for replay."""
        return f"{self.namespace}notif.webhook.skipped"

    @property
    def audit(self) -> str:
        """Every operator change: who, what, before, after, when."""
        return f"{self.namespace}notif.audit"

    @property
    def endpoint_health_app(self) -> str:
        """The endpoint-health app's id: its consumer group and the prefix of its changelog topic."""
        return f"{self.namespace}endpoint-health"

    def group(self, channel: str, lane: str) -> str:
        """The lane workers' group."""
        return f"{self.namespace}dispatch.{channel}.{lane}"

    def retry_group(self, channel: str, lane: str) -> str:
        """The retriers' group: each lane's retriers own its retry topics (every tier)."""
        return f"{self.group(channel, lane)}.retry"

    def lag_follower_group(self, channel: str, lane: str) -> str:
        return f"{self.group(channel, lane)}.lag-follower"

    @property
    def recorder_group(self) -> str:
        return f"{self.namespace}status-recorder"

    @property
    def operator(self) -> str:
        """The operator log: limits, API keys and the Redis epoch (compacted)."""
        return f"{self.namespace}notif.operator"


def lag_key(channel: str) -> str:
    """The key of a channel's transactional lag reading in `notif.lag`."""
    return f"{channel}.transactional"


@dataclass(frozen=True)
class RedisKeys:
    """Redis key names. Gate keys share the tag `{provider}`; idempotency keys `{t:<tenant>}`."""

    namespace: str = ""

    # ---- the gate (one script call touches the limits, both buckets and the cool-down)
    def limits(self, provider: str) -> str:
        return f"{self.namespace}dr:{{{provider}}}:limits"

    def global_bucket(self, provider: str) -> str:
        return f"{self.namespace}dr:{{{provider}}}:global"

    def tenant_bucket(self, provider: str, tenant: str) -> str:
        return f"{self.namespace}dr:{{{provider}}}:tenant:{tenant}"

    def cool(self, provider: str) -> str:
        return f"{self.namespace}dr:{{{provider}}}:cool"

    def own_account_cool(self, provider: str, tenant: str) -> str:
        """What the gate reads as the cool-down of a tenant whose requests go out under its own account at the
        provider: set by that account's 429s (every worker sending under it holds off), so the shared account's
        cool-down never holds it."""
        return f"{self.namespace}dr:{{{provider}}}:cool:own:{tenant}"

    def own_account_global(self, provider: str, tenant: str) -> str:
        """The global bucket of a tenant whose requests go out under its own account at the provider: that
        account's requests never spend the shared account's tokens (the tenant's bucket is its account's limit)."""
        return f"{self.namespace}dr:{{{provider}}}:global:own:{tenant}"

    # ---- processed_jobs (one claim touches its lease, its request record and each send's key)
    def processed(self, tenant: str, send_id: str) -> str:
        return f"{self.namespace}dr:{{t:{tenant}}}:processed:{send_id}"

    def lease(self, tenant: str, request_key: str) -> str:
        return f"{self.namespace}dr:{{t:{tenant}}}:lease:{request_key}"

    def request(self, tenant: str, request_key: str) -> str:
        return f"{self.namespace}dr:{{t:{tenant}}}:request:{request_key}"

    # ---- webhook endpoints (a tenant's endpoints in one hash, under the tenant's tag)
    def endpoints(self, tenant: str) -> str:
        return f"{self.namespace}dr:{{t:{tenant}}}:endpoints"

    def endpoint_reservations(self, tenant: str) -> str:
        """Places held for a tenant's endpoints being created (counted against the most it may have)."""
        return f"{self.namespace}dr:{{t:{tenant}}}:endpoints:reserved"

    def endpoint_deliveries(self, endpoint_id: str, tenant_id: str) -> str:
        """A tenant's deliveries to an endpoint by time (a sorted set), for `GET /v1/endpoints/{id}/deliveries`:
        one per tenant, so that an event of another tenant naming the endpoint (written past ingest) is never
        listed, nor read past, under the owner's."""
        return f"{self.namespace}dr:{{{endpoint_id}}}:deliveries:{tenant_id}"

    def legacy_endpoint_deliveries(self, endpoint_id: str) -> str:
        """An endpoint's deliveries of every tenant, as recorded before the per-tenant index (2026-12-05), and by
        a recorder of that version during a rollout: still read (the tenant's own only) until its entries
        expire, 30 days after the last such write."""
        return f"{self.namespace}dr:{{{endpoint_id}}}:deliveries"

    def endpoint_backlog(self, endpoint_id: str) -> str:
        """An endpoint's undelivered deliveries by creation time (a sorted set): backlog shedding."""
        return f"{self.namespace}dr:{{{endpoint_id}}}:backlog"

    def members(self, tenant: str) -> str:
        """The email addresses of a tenant's project members (endpoint alerts go to them)."""
        return f"{self.namespace}dr:{{t:{tenant}}}:members"

    # ---- ingest
    def ingest_idempotency(self, tenant: str, key: str) -> str:
        """An Idempotency-Key of a tenant's ingest requests (its answer, 24 h)."""
        digest = hashlib.sha256(key.encode()).hexdigest()[:40]
        return f"{self.namespace}dr:{{t:{tenant}}}:idem:{digest}"

    def send_status(self, send_id: str) -> str:
        return f"{self.namespace}dr:send:{{{send_id}}}"

    def send_attempts(self, send_id: str) -> str:
        """The attempt history of a send (one hash field per attempt), beside its status."""
        return f"{self.namespace}dr:send:{{{send_id}}}:attempts"

    @property
    def api_keys(self) -> str:
        return f"{self.namespace}dr:apikeys"

    @property
    def sender_domains(self) -> str:
        """The sender domains an operator set, tenant (or `*`) -> JSON list."""
        return f"{self.namespace}dr:senders"

    @property
    def api_keys_used(self) -> str:
        """When each API key was last used (digest -> ms)."""
        return f"{self.namespace}dr:apikeys:used"

    @property
    def epoch(self) -> str:
        """Written once per Redis data set; its absence while the operator log knows an epoch means
        Redis lost its data."""
        return f"{self.namespace}dr:epoch"

    # ---- on a Redis Cluster, the epoch's markers: one in every hash slot, written with the epoch,
    # so that a script sees in its own slot whether that slot's data was lost (a cluster loses a
    # shard, not always the one holding the epoch). A single Redis loses all or nothing: there
    # the epoch itself is every script's marker.
    def epoch_marker(self, slot: int) -> str:
        return f"{self.namespace}dr:{{{slot_tags()[slot]}}}:epoch"

    def restored_marker(self, slot: int) -> str:
        """Present once the operator state whose keys hash to `slot` was restored after the slot lost its data
        (state/guard.py `restore`); it goes with the slot's data."""
        return f"{self.namespace}dr:{{{slot_tags()[slot]}}}:restored"

    def epoch_markers(self) -> list[str]:
        return [self.epoch_marker(slot) for slot in range(HASH_SLOTS)]

    def recovering(self, run: str) -> str:
        """Written as a `streams state recover` run starts, checked before it writes the epoch: gone means Redis
        lost its data again meanwhile (on a Redis Cluster, one in every hash slot: `recovering_markers`). Each run
        has its own, so that one run ending does not take away the markers of another running alongside it."""
        return f"{self.namespace}dr:recovering:{run}"

    def recovering_markers(self, run: str) -> list[str]:
        return [f"{self.namespace}dr:{{{slot_tags()[slot]}}}:recovering:{run}" for slot in range(HASH_SLOTS)]

    def tenant_epoch_marker(self, tenant: str) -> str:
        """The marker in the slot of the tenant's processed_jobs keys."""
        return self.epoch_marker(hash_slot(f"t:{tenant}"))
