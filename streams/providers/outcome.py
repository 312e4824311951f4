"""What a provider call means, independent of any HTTP library. Pure code.

A provider answer (status and body) maps to an `Outcome` the retry policy understands; error
bodies are redacted before they reach a log line or a DLQ header.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import orjson

# gone: the receiver answered 410 (a webhook endpoint that asks not to be called again);
# skipped: never attempted (the webhook endpoint was deleted or disabled before its turn).
Outcome = Literal["delivered", "throttled", "quota", "rejected", "unavailable", "unknown", "auth", "gone", "skipped"]
QUOTA_429 = frozenset({"daily_quota_exceeded", "monthly_quota_exceeded"})
_EMAIL_RE = re.compile(r"[^\s\"'<>@,;:]+@[^\s\"'<>@,;:]+")
_ENCODED_EMAIL_RE = re.compile(r"(?:[\w.+-]|%(?!40)[0-9A-Fa-f]{2})+%40(?:[\w.-]|%(?!40)[0-9A-Fa-f]{2})+")
_UP_TO_LAST_SPACE_RE = re.compile(r".*\s", re.DOTALL)
CUT_WORD_MAX = 256  # a word the excerpt's cut goes through is left out when at most this long (a key, a token)
_PHONE_RE = re.compile(r"\+?\d[\d\s().-]{6,}\d")
_BEARER_RE = re.compile(r"\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]+", re.IGNORECASE)
_JWT_RE = re.compile(r"\beyJ[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*")
_RESEND_KEY_RE = re.compile(r"\bre_[A-Za-z0-9_]+")
# Key shapes: providers' (sk_live_...), and ours: API keys (dr_ten_, dr_ope_); a webhook signing secret (base64).
_SECRET_KEY_RE = re.compile(r"\b(sk|pk|rk|key|dr_ten|dr_ope)_[A-Za-z0-9_-]{8,}")
_WEBHOOK_SECRET_RE = re.compile(r"\bwhsec_[A-Za-z0-9+/=]{8,}")


def _secret_key(match: re.Match[str]) -> str:
    """A key-shaped word (`sk_live_...`), unless it reads as a name (`key_not_found`: short, no digit)."""
    word = match.group(0)
    token = word[len(match.group(1)) + 1:]
    return f"{match.group(1)}_***" if len(token) >= 16 or any(c.isdigit() for c in token) else word


def redact(text: str, limit: int = 500, secrets: tuple[str, ...] = ()) -> str:
    """Strip what identifies a person or unlocks an account from a provider's error body: `secrets`
    (the key or token the request carried, whatever its shape), then bearer credentials, JWTs, API-key
    shapes, email addresses (percent-encoded too) and phone numbers."""
    for secret in secrets:
        if len(secret) >= 4:
            text = text.replace(secret, "***")
    if len(text) > 2 * limit:
        # Only the excerpt is kept: the patterns, some quadratic on long unbroken runs (holding the GIL, so every
        # thread of the worker, for seconds on a provider's 30 KB echo), read just its first part, without the
        # word the cut went through when it is short enough to be a secret cut short, which could slip past its
        # pattern (a longer run, compact JSON, is kept: its end lies past what the excerpt shows).
        head = text[:2 * limit]
        if not text[2 * limit].isspace():
            # Where the last word starts (one greedy match: linear, where searching for the word is quadratic
            # on a long unbroken run).
            space = _UP_TO_LAST_SPACE_RE.match(head)
            start = space.end() if space else 0
            text = head[:start] if len(head) - start <= CUT_WORD_MAX else head
        else:
            text = head
    text = _BEARER_RE.sub(lambda m: f"{m.group(1)} ***", text)
    text = _JWT_RE.sub("***", text)
    text = _RESEND_KEY_RE.sub("re_***", text)
    text = _SECRET_KEY_RE.sub(_secret_key, text)
    text = _WEBHOOK_SECRET_RE.sub("whsec_***", text)
    text = _ENCODED_EMAIL_RE.sub("***%40***", text)
    text = _EMAIL_RE.sub("***@***", text)
    return _PHONE_RE.sub("+***", text)[:limit]



# What a provider's error answer may echo of a request that no address or key pattern recognises: a recipient's
# name before its address, a quoted subject or text, a code in it, a credential written as `name=value`.
_NAMED_ADDRESS_RE = re.compile(r"(?:\b[A-Z][\w'-]*[ \t]+){1,3}(?=<[^<>@]*@[^<>]*>)")
# Quoted or bracketed spans; one left open runs to the end of the text. An apostrophe inside a word (`recipient's`,
# `can't`) opens nothing.
_QUOTED_RE = re.compile(r"\"[^\"]*(?:\"|\Z)|(?<![A-Za-z])'[^']*(?:'(?![A-Za-z])|\Z)|`[^`]*(?:`|\Z)|<[^<>]*(?:>|\Z)")
_IDENTIFIER_RE = re.compile(r"[A-Za-z0-9_./\[\]-]{1,40}")
_CREDENTIAL_RE = re.compile(
    r"(?<![A-Za-z0-9])((?:[A-Za-z0-9]+[_-])*(?:password|passwd|pwd|pass|secret|token|api[_-]?key|authorization|auth))"
    r"([\"']?\s*[=:]\s*)(\"[^\"]*\"?|'[^']*'?|[A-Za-z]+[ \t]+[A-Za-z0-9._~+/=-]{8,}|\S+)", re.IGNORECASE)
_DIGITS_RE = re.compile(r"(?<![A-Za-z0-9_])\d{4,}")
EXCERPT_FIELDS = ("name", "code", "type", "error", "error_code", "reason", "field", "param", "message", "detail",
                  "description", "title")
MAX_MESSAGE_ID_CHARS = 256  # a provider's message id (Resend's: a UUID, 36)
JSON_READ_MAX = 65_536  # a longer answer is read as text (cut first): parsing and walking it would hold the GIL


def provider_excerpt(body: str, limit: int = 500, secrets: tuple[str, ...] = ()) -> str:
    """What of an email or SMS provider's error answer may reach a log line or a retry / dead-letter header: its
    error fields (a JSON object's name, code, message..., also in nested objects and lists one level down, as
    `key: value`; other text as it is), `redact`ed, then without what an echo of the request brings and no
    pattern recognises. A quoted or bracketed span stays only when it is an identifier (a field name: `to`); a
    capitalised name before an address, a credential written as `name=value` and every run of 4 digits or more
    (a code, an order number; not one inside an identifier such as `req_12345`) go. Spans are masked before the
    cut, so one the cut would close is masked too."""
    text = body.lstrip(" \t\r\n\ufeff")
    if text[:1] in ("{", "[") and len(text) <= JSON_READ_MAX:
        text = _error_fields(text)
    text = redact(text, limit * 2, secrets)
    text = _CREDENTIAL_RE.sub(lambda m: f"{m.group(1)}{m.group(2)}***", text)
    text = _NAMED_ADDRESS_RE.sub("", text)
    text = _QUOTED_RE.sub(_span, text)
    return _DIGITS_RE.sub("***", text).strip()[:limit]


def _span(m: re.Match[str]) -> str:
    span = m.group(0)
    opening, closing = span[0], {"<": ">"}.get(span[0], span[0])
    inner, closed = (span[1:-1], closing) if len(span) > 1 and span[-1] == closing else (span[1:], "")
    return span if closed and _IDENTIFIER_RE.fullmatch(inner) else f"{opening}…{closed}"


def _error_fields(body: str) -> str:
    """A JSON error answer's error fields as `key: value; ...` (in nested objects, and the first objects of
    lists, one level down), else the names of its keys; the body itself when it is not JSON."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    if isinstance(doc, list):
        doc = next((d for d in doc[:3] if isinstance(d, dict)), None)
    if not isinstance(doc, dict):
        return "(a JSON answer that is not an object)"
    scopes = [doc]
    for value in doc.values():
        if isinstance(value, dict):
            scopes.append(value)
        elif isinstance(value, list):
            scopes.extend(d for d in value[:3] if isinstance(d, dict))
    parts = [f"{key}: {value}" for scope in scopes for key in EXCERPT_FIELDS
             if isinstance(value := scope.get(key), (str, int, float)) and not isinstance(value, bool)]
    return "; ".join(parts) if parts else f"(a JSON answer without error fields; its keys: {', '.join(list(doc)[:10])})"


@dataclass(frozen=True)
class ProviderResult:
    outcome: Outcome
    status: int | None = None
    message_ids: tuple[str, ...] = ()
    retry_after: str | None = None
    error_name: str = ""
    error_body: str = ""          # redacted
    latency_s: float = 0.0
    target: str = ""              # where the request went, when a send's route does not say (a webhook URL)
    # Sent a second time within the attempt (its first copy's connection closed unanswered), and this answer
    # is not a delivery: the provider may hold the first copy, so the sends stay claimed under the key, as
    # after any re-send.
    first_copy_unknown: bool = False
    # The request never left (no connection was made, no token could be had, our own checks stopped it): the
    # provider counted nothing, and the gate's tokens it took are given back.
    never_sent: bool = False


class UnusablePayload(Exception):
    """An adapter refusing one message's payload for a reason its message states (never quoting the
    payload): the message is dead-lettered `malformed` with that reason."""


@dataclass(frozen=True)
class Outbound:
    """One message for the provider: the frozen payload plus the routing tags we attach."""

    send_id: str
    tenant: str
    lane: str
    payload: dict

    def tags(self) -> list[dict]:
        tags = self.payload.get("tags")
        own = [t for t in tags if isinstance(t, dict)] if isinstance(tags, list) else []  # `null`: no tags
        return own + [{"name": "send_id", "value": self.send_id}, {"name": "tenant", "value": self.tenant},
                      {"name": "lane", "value": self.lane}]


_ERROR_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def safe_error_name(name: str) -> str:
    """A provider's error name as we pass it on (logs, dead-letter headers, the attempt history, a metric label):
    a short code such as `rate_limit_exceeded`; anything else (free text that may quote an address, an unbounded
    string that would grow a label's values) becomes `other`."""
    return name if not name or _ERROR_NAME_RE.fullmatch(name) else "other"


def error_name(body: bytes) -> str:
    """The `name` field of a JSON error body ("" when there is none)."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return ""
    return str(doc.get("name", "")) if isinstance(doc, dict) else ""


# A 5xx may come after the provider acted on the request (a 500 or 503 from a server or proxy that
# failed once the work was done, a gateway that lost the upstream's answer), and no provider we use
# documents a 5xx that means "not processed". So a 5xx is an unknown outcome, as is a 409 saying the
# first request under the same idempotency key is still running: the same body goes again under the
# same key, never re-batched under a new one. Only 501 and 505 (the method or the HTTP version
# refused) say the request was never acted on.
NOT_ACTED_ON_5XX = frozenset({501, 505})


# A 400 or 403 that names our key as the fault (Resend's 403 for a key deleted from its dashboard; its 400 for an
# Authorization header that is no key at all, which the Resend adapter names so): like a 401, the key has to be fixed;
# any other 400 or 403 (a field refused, a sender domain not verified, a destination not allowed) is about the message.
KEY_REFUSED = frozenset({"invalid_api_key"})


def classify(status: int, name: str) -> Outcome:
    """The outcome of a non-2xx answer with error name `name`."""
    if status == 429:
        return "quota" if name in QUOTA_429 else "throttled"
    if status == 401 or (status in (400, 403) and name in KEY_REFUSED):
        return "auth"
    if status == 409 and name == "concurrent_idempotent_requests":
        return "unknown"  # the first request is still running: ask again later with the same key
    if status == 409 and name == "invalid_idempotent_request":
        # Our key came with another body before, which the provider took: its messages may be out. Never a
        # rejection (dead-lettered `permanent_error`, a replay would send them again): asked again under the same
        # key, it ends dead-lettered `unknown_outcome`, for an operator to check before any replay.
        return "unknown"
    if status == 408:
        return "unavailable"  # the server timed out before it had read the whole request: retried
    if 400 <= status < 500:
        return "rejected"
    if 500 <= status < 600 and status not in NOT_ACTED_ON_5XX:
        return "unknown"
    return "unavailable"


# RFC 6749 5.2's errors that say our client's registration or settings are wrong: they do not go away by retrying.
OAUTH_CONFIG_ERRORS = frozenset({"invalid_client", "unauthorized_client", "unsupported_grant_type", "invalid_grant",
                                 "invalid_scope"})


def token_outcome(status: int, error: str) -> Outcome:
    """The outcome of a request whose token the token endpoint refused with `status` (OAuth `error`).
    Our client credentials refused (401, 403, or a 400 with an error of OAUTH_CONFIG_ERRORS) is `auth`, as a 401 at
    the send endpoint; a 429 is `throttled`; anything else `unavailable`. The send endpoint was never
    called, so nothing can have been accepted."""
    if status in (401, 403) or (status == 400 and error in OAUTH_CONFIG_ERRORS):
        return "auth"
    if status == 429:
        return "throttled"
    return "unavailable"


def message_ids(body: bytes) -> tuple[str, ...]:
    """Message ids from a 2xx body: `{"id": ...}` or `{"data": [{"id": ...}, ...]}`."""
    doc = orjson.loads(body)
    if isinstance(doc, dict) and isinstance(doc.get("data"), list):
        return tuple(message_id(d.get("id")) for d in doc["data"])
    return (message_id(doc.get("id")),) if isinstance(doc, dict) else ()


def message_id(value: object) -> str:
    """A message id as text; "" for none (missing, null): a null id names no message. Anything but a string or
    an integer (`false`, an object), or one longer than MAX_MESSAGE_ID_CHARS, is no id to keep: raised (the answer
    is unreadable). Kept, a 1.6 MB id made the outcome record too large for the broker: the worker stopped, and
    the provider answered the same to the request sent again at each restart."""
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise TypeError(f"a message id is a string or an integer, not {type(value).__name__}")
    text = str(value)
    if len(text) > MAX_MESSAGE_ID_CHARS:
        raise ValueError(f"a message id of {len(text)} characters (at most {MAX_MESSAGE_ID_CHARS})")
    return text
