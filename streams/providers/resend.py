"""Resend's `POST /emails` and `POST /emails/batch` (at most 100 emails per request)."""

from __future__ import annotations

import orjson

from .http import HttpProvider
from .outcome import Outbound

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
