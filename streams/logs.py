"""Log lines: plain text or JSON (`--log-format json`, `LOG_FORMAT=json`), and evidence lines.

An evidence line records one fact an operator may need later (an attempt that failed, a retry
scheduled, a dead letter) as an event name plus fields: `attempt_failed send_id=... status=429`
in text, the same fields as JSON keys in JSON. Fields carry ids, statuses, durations and redacted
excerpts only: no addresses, phone numbers, message bodies or keys.
"""

from __future__ import annotations

import logging
import re
import sys
from typing import Any

import orjson

_TEXT = "%(asctime)s %(levelname)s %(name)s %(message)s"


_PLAIN = re.compile(r"[^\s=\"\\]*")  # a text field's value shown as it is: no space, `=`, quote or backslash


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None)
        # The line's own keys come last: a field named `ts`, `level`, `logger` or `msg` never stands for them.
        doc: dict[str, Any] = {**(fields if isinstance(fields, dict) else {}), "ts": round(record.created, 3),
                               "level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(doc, default=str).decode()


def setup(level: str = "INFO", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_TEXT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # httpx logs every request at INFO with its full URL (a webhook URL may carry a token): warnings only.
    for chatty in ("httpx", "httpcore"):
        logging.getLogger(chatty).setLevel(logging.WARNING)


def evidence(logger: logging.Logger, level: int, event: str, **fields: Any) -> None:
    """One line: `event k=v ...` in text, `{"msg": event, k: v ...}` in JSON. A text value holding a space, `=`,
    a quote, a backslash, a line break or another control character (a provider's answer, a dead letter's
    detail) is quoted as a JSON string: never a field of its own making, nor a line, nor a terminal's escape."""
    if logger.isEnabledFor(level):
        text = " ".join(f"{k}={_shown(v)}" for k, v in fields.items() if v not in (None, ""))
        logger.log(level, "%s %s", event, text, extra={"fields": {"event": event, **fields}})


def _shown(value: Any) -> str:
    text = str(value)
    return text if text.isprintable() and _PLAIN.fullmatch(text) else orjson.dumps(text).decode()
