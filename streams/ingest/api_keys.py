"""Ingest API keys: stored as SHA-256 digests in Redis, each with a role (and a tenant)."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Literal

import orjson
import redis

from ..errors import ConfigError, StoreUnavailable
from ..names import RedisKeys


@dataclass(frozen=True)
class Principal:
    role: Literal["tenant", "operator"]
    tenant: str | None


class ApiKeys:
    def __init__(self, client: redis.Redis, namespace: str = ""):
        self.client = client
        self.key = RedisKeys(namespace).api_keys

    def create(self, role: str, tenant: str | None = None) -> str:
        if role == "tenant" and not tenant:
            raise ConfigError("a tenant key needs a tenant id")
        token = f"dr_{role[:3]}_{secrets.token_urlsafe(24)}"
        try:
            self.client.hset(self.key, hashlib.sha256(token.encode()).hexdigest(),
                             orjson.dumps({"role": role, "tenant": tenant}))
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
