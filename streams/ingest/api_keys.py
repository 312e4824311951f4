"""Ingest API keys: stored as SHA-256 digests in Redis, each with a role (and a tenant)."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import orjson
import redis

from ..errors import ConfigError, SendValidationError, StoreUnavailable
from ..names import RedisKeys
from ..send import check_tenant_id

if TYPE_CHECKING:
    from ..state.log import OperatorLog


@dataclass(frozen=True)
class Principal:
    role: Literal["tenant", "operator"]
    tenant: str | None


class ApiKeys:
    """Keys are written to the operator log (`oplog`, acknowledged) before Redis, so they outlive
    a loss of Redis data; see LimitStore for stores without one."""

    def __init__(self, client: redis.Redis, namespace: str = "", oplog: OperatorLog | None = None):
        self.client = client
        self.key = RedisKeys(namespace).api_keys
        self.oplog = oplog

    def create(self, role: str, tenant: str | None = None) -> str:
        if role == "tenant":
            try:
                check_tenant_id(tenant or "")
            except SendValidationError as exc:
                raise ConfigError(str(exc)) from None
        token = f"dr_{role[:3]}_{secrets.token_urlsafe(24)}"
        digest = hashlib.sha256(token.encode()).hexdigest()
        entry = {"role": role, "tenant": tenant}
        if self.oplog is not None:
            self.oplog.put(f"apikey/{digest}", entry)
        try:
            self.client.hset(self.key, digest, orjson.dumps(entry))
        except redis.RedisError as exc:
            raise StoreUnavailable(f"cannot store the API key ({exc})") from None
        return token

    def resolve(self, token: str) -> Principal | None:
        try:
            raw = self.client.hget(self.key, hashlib.sha256(token.encode()).hexdigest())
        except redis.RedisError as exc:
            raise StoreUnavailable(f"cannot check the API key ({exc})") from None
        if not raw:
            return None
        doc = orjson.loads(raw)
        return Principal(doc["role"], doc.get("tenant"))
