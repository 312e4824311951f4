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
import traceback
from typing import Any

import orjson
from confluent_kafka import KafkaException
from redis.exceptions import RedisError

from .errors import DispatchError

_TEXT = "%(asctime)s %(levelname)s %(name)s %(message)s"


_PLAIN = re.compile(r"[^\s=\"\\]*")  # a text field's value shown as it is: no space, `=`, quote or backslash


# Exceptions whose text is a report this project or a dependency writes (the project's own errors, written without
# addresses, numbers or bodies; a broker's or Redis's error; the operating system's, a connection refused): a logged
# traceback shows it. Any other exception's text may hold what the code was handling when it failed (a recipient, a
# payload, a webhook URL, which is a credential for some receivers): its class and frames are logged, its text
# withheld. That includes an OSError of a library's own class (an HTTP client's timeout names the URL it called).
TEXT_SHOWN: tuple[type[BaseException], ...] = (DispatchError, KafkaException, RedisError)
_OS_MODULES = frozenset({"builtins", "socket", "ssl"})


def _text_shown(exc: BaseException) -> bool:
    return isinstance(exc, TEXT_SHOWN) or (isinstance(exc, OSError) and type(exc).__module__ in _OS_MODULES)


def traceback_shown(exc: BaseException) -> str:
    """The traceback of `exc` (and of the exceptions it was raised from or while handling, after it): each
    exception's class and frames (file, line, function, the line of code), its text only when TEXT_SHOWN or the
    operating system's. The exceptions inside an ExceptionGroup are named by class."""
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        kind = type(current)
        text = str(current) if _text_shown(current) else "(its text withheld)"
        parts.append("Traceback (most recent call last):\n" + "".join(traceback.format_tb(current.__traceback__))
                     + f"{kind.__module__}.{kind.__qualname__}: {text}")
        if isinstance(current, BaseExceptionGroup):
            parts.append(f" (holding {', '.join(type(e).__qualname__ for e in current.exceptions)})")
        if current.__cause__ is not None:
            parts.append("\nwhich was raised from:\n")
            current = current.__cause__
        elif current.__context__ is not None and not current.__suppress_context__:
            parts.append("\nwhich was raised while handling:\n")
            current = current.__context__
        else:
            current = None
    return "".join(parts)


class _TracebackShown(logging.Formatter):
    """Every traceback a log line carries, from any logger (the API server's included), as `traceback_shown`."""

    def formatException(self, ei) -> str:  # noqa: N802 - logging's name
        return traceback_shown(ei[1]) if ei[1] is not None else ""

    def format(self, record: logging.LogRecord) -> str:
        record.exc_text = None  # a traceback another handler's formatter cached on the record may hold the text
        return super().format(record)


class TextFormatter(_TracebackShown):
    def __init__(self) -> None:
        super().__init__(_TEXT)


class JsonFormatter(_TracebackShown):
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
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
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
