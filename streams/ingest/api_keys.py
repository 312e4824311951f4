"""Ingest API keys, with a lifecycle: created, listed, rotated (the old key stays valid for a chosen
overlap), revoked; the time each was last used.

A key is shown once, when it is made. What is kept is its SHA-256 digest (in Redis, and first in the
operator log, so keys outlive a loss of Redis data), its id (the first 12 hex digits of the digest:
safe to show and log), role, tenant, creation time, and, once rotated or revoked, when it stops
working. A key is looked up by its digest and the stored digest is compared in constant time. Every
API process reads Redis on every request, so a revoked key is refused by all of them at once.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import TYPE_CHECKING, Literal

import orjson
import redis

from ..errors import ConfigError, PublishError, SendValidationError, StoreUnavailable
from ..names import RedisKeys
from ..redis_client import SET_FIELD_IF_UNCHANGED, store_errors
from ..send import check_tenant_id
from ..state.log import write_through_log

if TYPE_CHECKING:
    from ..state.log import OperatorLog

LAST_USED_EVERY_S = 60  # last-used times are written at most this often per key
CHANGE_ATTEMPTS = 10
log = logging.getLogger("streams.api_keys")


@dataclass(frozen=True)
class Principal:
    role: Literal["tenant", "operator"]
    tenant: str | None
    key_id: str = ""


@dataclass(frozen=True)
class KeyInfo:
    id: str
    role: str
    tenant: str | None
    created_at_ms: int = 0
    expires_at_ms: int | None = None   # a rotated key: valid until then
    revoked_at_ms: int | None = None
    last_used_ms: int | None = None
    label: str = ""

    def valid(self, now_ms: int) -> bool:
        return self.revoked_at_ms is None and (self.expires_at_ms is None or now_ms < self.expires_at_ms)


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def key_id(token: str) -> str:
    """The id a key is listed, revoked and audited by (from the key itself: no store is asked)."""
    return _digest(token)[:12]


def _grants_less(doc: dict, before: dict) -> bool:
    """`doc` revokes the key, or ends it sooner, than `before` did."""
    never = float("inf")
    return ((bool(doc.get("revoked_at_ms")) and not before.get("revoked_at_ms"))
            or (doc.get("expires_at_ms") or never) < (before.get("expires_at_ms") or never))


class ApiKeys:
    """Keys are written to the operator log (`oplog`, acknowledged) before Redis, so they outlive
    a loss of Redis data; see LimitStore for stores without one."""

    def __init__(self, client: redis.Redis, namespace: str = "", oplog: OperatorLog | None = None):
        self.client = client
        self.keys = RedisKeys(namespace)
        self.key = self.keys.api_keys
        self.oplog = oplog
        self._used: dict[str, float] = {}
        self._set_if_unchanged = client.register_script(SET_FIELD_IF_UNCHANGED)

    # ------------------------------------------------------------------ lifecycle
    def create(self, role: str, tenant: str | None = None, label: str = "") -> str:
        if role not in ("tenant", "operator"):
            raise ConfigError(f"role must be tenant or operator, not {role!r}")
        if role == "tenant":
            try:
                check_tenant_id(tenant or "")
            except SendValidationError as exc:
                raise ConfigError(str(exc)) from None
        token = f"dr_{role[:3]}_{secrets.token_urlsafe(24)}"
        digest = _digest(token)
        self._save(digest, {"role": role, "tenant": tenant if role == "tenant" else None,
                            "created_at_ms": int(time.time() * 1000), "label": label[:100]})
        return token

    def list(self, tenant: str | None = None) -> list[KeyInfo]:
        """Every key (of one tenant), newest first; never the keys themselves."""
        with store_errors("listing API keys"):
            raw = self.client.hgetall(self.key)
            used = self.client.hgetall(self.keys.api_keys_used)
        out = []
        for digest, value in raw.items():
            info = self._info(digest.decode(), orjson.loads(value), used.get(digest))
            if tenant is None or info.tenant == tenant:
                out.append(info)
        return sorted(out, key=lambda k: k.created_at_ms, reverse=True)

    def get(self, key_id: str) -> KeyInfo | None:
        return next((k for k in self.list() if k.id == key_id), None)

    def revoke(self, key_id: str) -> KeyInfo | None:
        """Refused from now on, by every API process (revoked again, it keeps its first revocation's time)."""
        now = int(time.time() * 1000)
        return self._change(key_id, lambda doc: {**doc, "revoked_at_ms": doc.get("revoked_at_ms") or now})

    def rotate(self, key_id: str, overlap_s: int = 24 * 3600) -> tuple[str, KeyInfo] | None:
        """A new key with the same role and tenant; the old one keeps working `overlap_s` seconds (a key already
        rotated keeps its earlier end if that comes sooner: rotating again never extends a key being retired)."""
        old = self.get(key_id)
        if old is None or not old.valid(int(time.time() * 1000)):
            return None
        if not 0 <= overlap_s <= 30 * 24 * 3600:
            raise ConfigError(f"overlap must be between 0 and 30 days (got {overlap_s} s)")
        token = self.create(old.role, old.tenant, old.label)
        ends = int(time.time() * 1000) + overlap_s * 1000
        # Rotated before (by another operator meanwhile, too): its end may come sooner, never later.
        try:
            changed = self._change(key_id, lambda doc: {**doc,
                                                        "expires_at_ms": min(ends, doc.get("expires_at_ms") or ends)})
        except (StoreUnavailable, PublishError):
            try:  # the new key is never shown to anyone: it must not stay valid
                self.revoke(_digest(token)[:12])
            except (StoreUnavailable, PublishError) as exc:
                log.warning("API key %s: its rotation failed, and the new key (never shown) could not be revoked "
                            "(%s): revoke %s", key_id, exc, _digest(token)[:12])
            raise
        assert changed is not None
        return token, changed

    # ------------------------------------------------------------------ checking
    def resolve(self, token: str) -> Principal | None:
        digest = _digest(token)
        with store_errors("checking the API key"):
            raw = self.client.hget(self.key, digest)
        if not raw:
            return None
        doc = orjson.loads(raw)
        stored = doc.get("digest", digest)
        if not hmac.compare_digest(stored, digest):
            return None
        info = self._info(digest, doc, None)
        if not info.valid(int(time.time() * 1000)):
            return None
        self._touch(digest)
        return Principal(doc["role"], doc.get("tenant"), info.id)

    # ------------------------------------------------------------------ storage
    def _touch(self, digest: str) -> None:
        now = time.time()
        if now - self._used.get(digest, 0) < LAST_USED_EVERY_S:
            return
        self._used[digest] = now
        try:
            self.client.hset(self.keys.api_keys_used, digest, int(now * 1000))
        except redis.RedisError:
            pass  # a last-used time is a convenience: never a reason to refuse a request

    def _change(self, key_id: str, update: Callable[[dict], dict]) -> KeyInfo | None:
        """Write `update(record)` over a key's record, compare-and-set: a change written by another process
        since this one read the record (a revocation landing in the middle of a rotation) is read again,
        updated again and kept, never overwritten with the older record."""
        for _ in range(CHANGE_ATTEMPTS):
            with store_errors("reading API keys"):
                raw = self.client.hgetall(self.key)
            found = next(((d.decode(), v) for d, v in raw.items() if d.decode()[:12] == key_id), None)
            if found is None:
                return None
            digest, stored = found
            doc = update(orjson.loads(stored))
            if self._save(digest, doc, stored):
                return self._info(digest, doc, None)
        raise StoreUnavailable(f"API key {key_id} kept changing under this change ({CHANGE_ATTEMPTS} attempts)")

    def _raw(self, digest: str) -> bytes | None:
        with store_errors("reading API keys"):
            return self.client.hget(self.key, digest)

    def _save(self, digest: str, doc: dict, expected: bytes | None = None) -> bool:
        """Write the record (first to the operator log, which then ends with what Redis holds, whoever won; a write
        Redis refuses is taken back out of it); with `expected`, only if the stored record is still exactly that
        (False: it changed meanwhile)."""
        doc = {**doc, "digest": digest}

        def write() -> bool:
            with store_errors("storing the API key"):
                if expected is None:
                    self.client.hset(self.key, digest, orjson.dumps(doc))
                    return True
                return bool(self._set_if_unchanged(keys=[self.key], args=[digest, expected, orjson.dumps(doc)]))

        before = orjson.loads(expected) if expected else None
        # Taken back while Redis cannot say what it holds (its answer lost, then a look at it failed), the log keeps
        # a revocation or earlier end: a rebuild of Redis from it may then end a key that Redis still held valid
        # (the operator was told to retry), never bring back one Redis held revoked.
        kept = doc if before is not None and _grants_less(doc, before) else before
        return write_through_log(self.oplog, f"apikey/{digest}", doc, write, partial(self._raw, digest),
                                 kept_if_unknown=kept)

    @staticmethod
    def _info(digest: str, doc: dict, used: bytes | None) -> KeyInfo:
        return KeyInfo(digest[:12], doc["role"], doc.get("tenant"), doc.get("created_at_ms", 0),
                       doc.get("expires_at_ms"), doc.get("revoked_at_ms"), int(used) if used else None,
                       doc.get("label", ""))



def public(info: KeyInfo) -> dict:
    return asdict(info)
