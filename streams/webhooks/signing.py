"""Standard Webhooks signatures (https://www.standardwebhooks.com). Pure code.

Every delivery carries `webhook-id` (the delivery's id, stable across its retries: receivers
deduplicate with it), `webhook-timestamp` (Unix seconds of this attempt) and `webhook-signature`:
`v1,<base64 HMAC-SHA256 over "<id>.<timestamp>.<body>">`, one per valid secret, space-separated
(during a secret rotation both the new and the old secret sign). A secret is `whsec_` followed by
the base64 of its key bytes.

`verify()` is the receiver's side, shipped for the tenants' own receivers and used by our tests and
mock receiver: it checks the timestamp tolerance and any one of the signatures, in constant time.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable, Mapping

PREFIX = "whsec_"
TOLERANCE_S = 300
_UNIX_TIME_RE = re.compile(r"[0-9]{1,12}")  # ASCII digits only, seconds


class InvalidSignature(ValueError):
    """A delivery whose headers do not prove it came from us (the message says what is wrong)."""


def new_secret() -> str:
    return PREFIX + base64.b64encode(secrets.token_bytes(24)).decode()


def _key(secret: str) -> bytes:
    return base64.b64decode(secret.removeprefix(PREFIX))


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """`v1,<signature>` of one secret."""
    mac = hmac.new(_key(secret), f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def signature_header(secrets_: Iterable[str], msg_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` value: one signature per valid secret, space-separated."""
    return " ".join(sign(s, msg_id, timestamp, body) for s in secrets_)


def headers(secrets_: Iterable[str], msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    return {"webhook-id": msg_id, "webhook-timestamp": str(timestamp),
            "webhook-signature": signature_header(secrets_, msg_id, timestamp, body)}


def verify(headers_: Mapping[str, str], body: bytes | str, secret: str, now: float,
           tolerance_s: int = TOLERANCE_S) -> None:
    """Raise InvalidSignature unless `headers_` carry a valid signature of `body` by `secret`, with a
    timestamp within `tolerance_s` of `now` (replays of old deliveries are refused)."""
    h = {k.lower(): v for k, v in headers_.items()}
    msg_id, timestamp, signatures = h.get("webhook-id"), h.get("webhook-timestamp"), h.get("webhook-signature")
    if not msg_id or not timestamp or not signatures:
        raise InvalidSignature("missing webhook-id, webhook-timestamp or webhook-signature")
    if not _UNIX_TIME_RE.fullmatch(timestamp):  # `int()` also takes 400 digits (then overflows), `+1`, `1_0`, `１`
        raise InvalidSignature(f"webhook-timestamp is not a Unix time: {timestamp[:20]!r}")
    ts = int(timestamp)
    if abs(now - ts) > tolerance_s:
        raise InvalidSignature(f"webhook-timestamp is {now - ts:.0f} s from now (tolerance {tolerance_s} s)")
    raw = body.encode() if isinstance(body, str) else body
    expected = sign(secret, msg_id, ts, raw).encode()
    for candidate in signatures.split():
        if candidate.startswith("v1,") and hmac.compare_digest(candidate.encode(), expected):
            return
    raise InvalidSignature("no signature matches this secret")
