"""An SMS gateway's `POST /sms/messages` (one message per request; Resend-shaped answers)."""

from __future__ import annotations

import orjson

from .http import HttpProvider
from .outcome import Outbound


class SmsGateway(HttpProvider):
    def build(self, messages: list[Outbound], batch: bool) -> tuple[str, bytes]:
        if batch or len(messages) != 1:
            raise ValueError("the SMS gateway takes one message per request")
        m = messages[0]
        return "/sms/messages", orjson.dumps({"to": m.payload["to"], "body": m.payload["body"],
                                              "tags": m.tags()})
