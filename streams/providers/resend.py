"""Resend's `POST /emails` and `POST /emails/batch` (at most 100 emails per request)."""

from __future__ import annotations

import orjson

from .http import HttpProvider
from .outcome import Outbound, error_name

RESEND_BATCH_MAX = 100


class ResendEmail(HttpProvider):
    _FIELDS = ("from", "to", "subject", "html", "text", "reply_to", "cc", "bcc", "headers")

    def build(self, messages: list[Outbound], batch: bool) -> tuple[str, bytes]:
        bodies = [{**{k: m.payload[k] for k in self._FIELDS if k in m.payload}, "tags": m.tags()}
                  for m in sorted(messages, key=lambda m: m.send_id)]
        if batch:
            if not 1 <= len(bodies) <= RESEND_BATCH_MAX:
                raise ValueError(f"a Resend batch holds 1..{RESEND_BATCH_MAX} emails, got {len(bodies)}")
            return "/emails/batch", orjson.dumps(bodies)
        if len(bodies) != 1:
            raise ValueError("the single-email endpoint takes exactly one email")
        return "/emails", orjson.dumps(bodies[0])

    def parse_error(self, body: bytes) -> str:
        """Resend's `name`; but a key it cannot read at all (the Authorization header is no key: a mangled
        RESEND_API_KEYS entry) is answered 400 `validation_error` "API key is invalid": named `invalid_api_key`
        here, as Resend names a key it refuses, so the provider holds with an auth alert (as for a 401) instead of
        every send being dead-lettered `permanent_error` as a message Resend refused."""
        name = error_name(body)
        if name == "validation_error":
            try:
                doc = orjson.loads(body)
            except orjson.JSONDecodeError:
                return name
            message = doc.get("message") if isinstance(doc, dict) else None
            if isinstance(message, str) and message.strip().lower().startswith("api key is invalid"):
                return "invalid_api_key"
        return name
