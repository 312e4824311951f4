"""Webhook signing secrets sealed at rest. Pure code (AES-256-GCM, from `cryptography`).

An endpoint's signing secrets are stored in the operator log (a Kafka topic) and in Redis, and whoever
reads either could sign deliveries that the tenant's receiver takes for ours. With
`WEBHOOK_SECRET_KEYS` set, a secret is stored sealed:

    sealed:v1:<key id>:<base64 of a 12-byte nonce, the ciphertext and its 16-byte tag>

AES-256-GCM under that key, with the endpoint's id as associated data (a sealed secret copied onto
another endpoint does not open). The first key listed seals; every key listed opens, so a key is
rotated by listing a new one first, re-sealing (`streams endpoints reseal --tenant '*'`), then dropping the old one.
Secrets are opened only to sign a delivery; nothing else needs them in the clear. A secret stored
before keys were set stays as it was (`whsec_...`) until it is re-sealed or rotated.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

SEALED = "sealed:v1:"
KEY_ID = re.compile(r"[A-Za-z0-9_-]{1,32}")
NONCE_BYTES = 12


class UnsealError(ValueError):
    """A sealed secret that cannot be opened here (the message names the key id, never the secret)."""


@dataclass(frozen=True)
class Sealer:
    keys: tuple[tuple[str, bytes], ...] = field(repr=False)  # (key id, 32-byte key); the first seals

    @classmethod
    def parse(cls, text: str, where: str = "WEBHOOK_SECRET_KEYS") -> Sealer | None:
        """`id:base64-key,id:base64-key` (each key 32 random bytes, e.g. `openssl rand -base64 32`); empty:
        None (secrets are stored as they are). ValueError says which entry is wrong, never a key."""
        entries = [e.strip() for e in text.split(",") if e.strip()]
        keys: list[tuple[str, bytes]] = []
        for n, entry in enumerate(entries, 1):
            key_id, sep, encoded = entry.partition(":")
            if not sep or KEY_ID.fullmatch(key_id) is None:
                raise ValueError(f"{where}: entry {n} must be <key id>:<base64 key>, the id 1-32 of A-Z a-z 0-9 _ -")
            try:
                key = base64.b64decode(encoded, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError(f"{where}: the key of {key_id!r} is not base64") from None
            if len(key) != 32:
                raise ValueError(f"{where}: the key of {key_id!r} is {len(key)} bytes; AES-256 takes 32")
            if key_id in dict(keys):
                raise ValueError(f"{where}: the key id {key_id!r} is listed twice")
            keys.append((key_id, key))
        return cls(tuple(keys)) if keys else None

    def seal(self, secret: str, endpoint_id: str) -> str:
        key_id, key = self.keys[0]
        nonce = os.urandom(NONCE_BYTES)
        sealed = AESGCM(key).encrypt(nonce, secret.encode(), endpoint_id.encode())
        return f"{SEALED}{key_id}:{base64.b64encode(nonce + sealed).decode()}"

    def reseal(self, value: str, endpoint_id: str) -> str:
        """A stored value sealed under the first key (as it is when it already is; in the clear or under an
        older key: opened and sealed again). UnsealError: no key listed opens it."""
        if value.startswith(f"{SEALED}{self.keys[0][0]}:"):
            return value
        return self.seal(open_secret(value, endpoint_id, self), endpoint_id)

    def open(self, value: str, endpoint_id: str) -> str:
        key_id, _, encoded = value.removeprefix(SEALED).partition(":")
        key = dict(self.keys).get(key_id)
        if key is None:
            raise UnsealError(f"a signing secret of endpoint {endpoint_id} is sealed with key {key_id!r}, "
                              f"which WEBHOOK_SECRET_KEYS does not list")
        try:
            raw = base64.b64decode(encoded, validate=True)
            return AESGCM(key).decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], endpoint_id.encode()).decode()
        except (binascii.Error, ValueError, InvalidTag):
            raise UnsealError(f"a signing secret of endpoint {endpoint_id} does not open with key {key_id!r} "
                              f"(altered, or sealed for another endpoint)") from None


def is_sealed(value: str) -> bool:
    return value.startswith(SEALED)


def sealed_with(value: str) -> str | None:
    """The id of the key a stored secret is sealed under (None: stored in the clear); never the secret."""
    return value.removeprefix(SEALED).partition(":")[0] if is_sealed(value) else None


def seal(secret: str, endpoint_id: str, sealer: Sealer | None) -> str:
    """What is stored for a new secret: sealed when keys are set, else the secret itself."""
    return secret if sealer is None or is_sealed(secret) else sealer.seal(secret, endpoint_id)


def open_secret(value: str, endpoint_id: str, sealer: Sealer | None) -> str:
    """The secret of a stored value (one stored before keys were set is the secret itself)."""
    if not is_sealed(value):
        return value
    if sealer is None:
        raise UnsealError(f"a signing secret of endpoint {endpoint_id} is sealed, and WEBHOOK_SECRET_KEYS is not set")
    return sealer.open(value, endpoint_id)
