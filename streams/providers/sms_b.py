"""A second SMS provider's protocol: `POST /v2/messages` with a short-lived bearer token (from
`POST /oauth/token`), one message per request.

    request   {"destination": "+1...", "text": "...", "reference": "<send id>", "metadata": {tags}}
    2xx       {"message": {"sid": "SM..."}}
    error     {"error": {"code": "unsupported_destination", "message": "..."}}
"""

from __future__ import annotations

import orjson

from .http import HttpProvider
from .outcome import Outbound, message_id


class SmsGatewayB(HttpProvider):
    def build(self, messages: list[Outbound], batch: bool) -> tuple[str, bytes]:
        if batch or len(messages) != 1:
            raise ValueError("this SMS provider takes one message per request")
        m = messages[0]
        return "/v2/messages", orjson.dumps({"destination": m.payload["to"], "text": m.payload["body"],
                                             "reference": m.send_id,
                                             "metadata": {t["name"]: t["value"] for t in m.tags()}})

    def parse_ids(self, body: bytes) -> tuple[str, ...]:
        doc = orjson.loads(body)
        return (message_id((doc.get("message") or {}).get("sid")),)

    def parse_error(self, body: bytes) -> str:
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            return ""
        error = doc.get("error") if isinstance(doc, dict) else None
        return str(error.get("code", "")) if isinstance(error, dict) else ""
