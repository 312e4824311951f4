"""The send: what a producer submits, and the versioned event that travels on the lane topics.

One schema serves the Python SDK, the HTTP ingest API (which also publishes it as OpenAPI) and
the workers. The event is serialized once, at ingest, with orjson; after that its bytes are
never re-encoded, so the rendered payload travels byte-identical through retries and the DLQ.
Unknown fields are tolerated; missing required ones are rejected.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from .errors import MalformedEvent, PayloadError, SendValidationError, format_field_errors
from .lanes import CATEGORY_TO_LANE, Category, Channel, Lane, lane_for
from .providers.outcome import redact
from .retry.policy import PolicyRouting, default_routing, unknown_policy

SCHEMA_VERSION: Literal[1] = 1
MAX_RECIPIENTS = 50          # Resend accepts at most 50 recipients per email
MAX_BATCH = 1000             # sends per ingest batch (blast chunks); documented in the README
MAX_PAYLOAD_DEPTH = 64  # objects and arrays nested in a payload (the event's JSON encoder stops at 254)
MAX_SEND_BYTES = 1024 * 1024  # one send as published (the topics carry 1.5 MiB: room for retry and DLQ headers)
# Tags and tenant ids travel to providers as tags; Resend accepts only ASCII letters, digits, `_`
# and `-` there (up to 256), so that is all a tenant id (up to 64) or a tag may hold.
TAG_PATTERN = r"^[A-Za-z0-9_-]{1,256}$"
TENANT_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
EVENT_TYPE_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"
RESERVED_TAGS = frozenset({"send_id", "tenant", "lane"})  # the tags dispatch attaches itself

# Python's `\s`, spelled out: the OpenAPI publishes these patterns, and ECMA-262's `\s` (which JSON
# Schema validators use) is another set, so an address valid for one would be refused by the other.
WHITE_SPACE = r"\t\n\x0b\x0c\r\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
# No control character anywhere in an address, nor in its display name: a CR or LF there would
# start a new mail header at a provider that writes the address into one.
_CONTROLS = r"\x00-\x1f\x7f"
_ADDRESS = rf"[^@<>{WHITE_SPACE}{_CONTROLS}]+@[^@<>{WHITE_SPACE}{_CONTROLS}]+\.[^@<>{WHITE_SPACE}{_CONTROLS}]+"
_DISPLAY_NAME = rf"[^<>{_CONTROLS}\x85\u2028\u2029]*"  # nor a line or paragraph separator
EMAIL_PATTERN = rf"^{_ADDRESS}$|^{_DISPLAY_NAME}<{_ADDRESS}>$"  # what check_address accepts, as one pattern
# Matched whole (`fullmatch`): Python's `$` also matches before a final newline, JSON Schema's does not.
_ANY_EMAIL = re.compile(rf"{_ADDRESS}|{_DISPLAY_NAME}<{_ADDRESS}>")
# ASCII digits only: JSON Schema's `\d` means 0-9, pydantic's (Rust) and Python's any Unicode digit.
_E164 = re.compile(r"^\+[1-9][0-9]{6,14}$")
_IDENT = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
# RFC 3339 date-time (JSON Schema's `date-time`): `t` and `z` in either case, any fraction, leap seconds.
_RFC3339 = re.compile(r"(\d{4})-(\d\d)-(\d\d)[Tt](\d\d):(\d\d):(\d\d)(?:\.\d+)?(?:[Zz]|[+-](\d\d):(\d\d))",
                      re.ASCII)

Ident = Annotated[str, Field(pattern=_IDENT.pattern)]
TenantId = Annotated[str, Field(pattern=TENANT_ID_PATTERN)]
# What a send id read from a lane event may be (dispatch's are UUIDs): it is copied into outcome records, and a
# megabyte's "id" would make a record of a hundred outcomes one the broker refuses.
SendId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]


def new_send_id(now_ms: int | None = None, seed: bytes | None = None) -> str:
    """A UUIDv7 (RFC 9562): 48-bit Unix milliseconds then random bits, so ids sort by creation.
    With `seed`, the "random" bits come from it: the same milliseconds and seed give the same id
    (an idempotent request published again gets the same send ids, which dispatch delivers once)."""
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    rand = int.from_bytes(hashlib.sha256(seed).digest()[:10] if seed is not None else os.urandom(10), "big")
    value = (ms & ((1 << 48) - 1)) << 80 | rand & ((1 << 80) - 1)
    value = (value & ~(0xF << 76)) | (0x7 << 76)          # version 7
    value = (value & ~(0x3 << 62)) | (0x2 << 62)          # RFC 4122 variant
    return str(uuid.UUID(int=value))


def check_address(value: str) -> str:
    # The message does not repeat the value: these messages reach logs and DLQ headers.
    if _ANY_EMAIL.fullmatch(value) is None:
        raise ValueError("not an email address")
    return value


class Tag(BaseModel):
    """A provider tag (Resend's rules: ASCII letters, digits, `_` and `-`, up to 256 characters)."""

    name: str = Field(pattern=TAG_PATTERN, json_schema_extra={"not": {"enum": [*sorted(RESERVED_TAGS)]}},
                      description=f"not one of the names dispatch attaches itself ({', '.join(sorted(RESERVED_TAGS))})")
    value: str = Field(pattern=TAG_PATTERN)

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, v: str) -> str:
        if v in RESERVED_TAGS:
            raise ValueError(f"the tag name {v!r} is reserved for dispatch ({', '.join(sorted(RESERVED_TAGS))})")
        return v


def nested_deeper_than(value: object, limit: int) -> bool:
    """Whether objects and arrays nest more than `limit` levels in `value` (iterative: no recursion limit)."""
    level: list[tuple[object, int]] = [(value, 1)]
    while level:
        item, depth = level.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        level.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


# One header line each: a CR or LF would start another header (or the body) of the message the provider builds; nor
# any other control character (a tab aside) or line or paragraph separator. Said in the published schema as "none of
# them anywhere" (a pattern ending in `$` lets a final LF through in some regex engines).
_NOT_ONE_LINE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f\x85\u2028\u2029]")
ONE_LINE_SCHEMA: dict[str, Any] = {"not": {"pattern": _NOT_ONE_LINE.pattern}}
# Headers a tenant may not set through `headers`: the message's addresses and identity, which the fields above set
# and check (an address, the recipient cap), where receipts go, and its MIME structure, which the provider writes.
RESERVED_HEADERS = frozenset({
    "from", "sender", "to", "cc", "bcc", "reply-to", "subject", "return-path", "disposition-notification-to",
    "return-receipt-to", "mime-version", "content-type", "content-transfer-encoding"})
RESERVED_HEADER_PREFIX = "resent-"  # every Resent-* header: another message's addresses and identity
MAX_HEADERS = 50
MAX_HEADER_VALUE = 998  # RFC 5322's line length
HEADER_NAME = re.compile(r"[!-9;-~]{1,100}")  # RFC 5322's field name: printable ASCII but the colon
# What the send rules added since events were first published check on submission only (the ingest API, the SDK): a
# worker decoding an event accepted before sends it as it was accepted, rather than dead-letter it unreplayable.
ACCEPTED_EARLIER = "accepted_earlier"


def _any_case(name: str) -> str:
    """A JSON-schema pattern (no inline flags there) matching `name` in any letter case."""
    return "".join(f"[{c.upper()}{c.lower()}]" if c.isalpha() else c for c in name)  # letters and hyphens


_RESERVED_NAME_PATTERN = (f"^(?:{'|'.join(_any_case(n) for n in sorted(RESERVED_HEADERS))})$"
                          f"|^{_any_case(RESERVED_HEADER_PREFIX)}")
_HEADERS_SCHEMA = {
    "anyOf": [{"type": "object", "maxProperties": MAX_HEADERS,
               "propertyNames": {"minLength": 1, "maxLength": 100, "not": {"anyOf": [
                   {"pattern": "[^!-9;-~]"}, {"pattern": _RESERVED_NAME_PATTERN}]}},
               "additionalProperties": {"type": "string", "maxLength": MAX_HEADER_VALUE, **ONE_LINE_SCHEMA}},
              {"type": "null"}],
    "description": f"custom headers (up to {MAX_HEADERS}), one line each; not the ones the fields set or the provider "
                   f"writes ({', '.join(sorted(RESERVED_HEADERS))}, Resent-*, in any case)"}


def _submitted(info: ValidationInfo) -> bool:
    return not (isinstance(info.context, dict) and info.context.get(ACCEPTED_EARLIER))


def _header_name(name: str, info: ValidationInfo) -> str:
    # The messages name the header, never its value (they reach logs and DLQ headers).
    if not _submitted(info):
        return name
    if HEADER_NAME.fullmatch(name) is None:
        raise ValueError("not a header name (1-100 printable ASCII characters, no colon or space)")
    if name.lower() in RESERVED_HEADERS or name.lower().startswith(RESERVED_HEADER_PREFIX):
        raise ValueError("set by dispatch from the send's own fields (the sender by `from`, checked against the "
                         "tenant's domains; recipients by `to`, `cc`, `bcc`) or by the provider, not through "
                         "`headers`")
    return name


def _header_value(value: str, info: ValidationInfo) -> str:
    if not _submitted(info):
        return value
    if len(value) > MAX_HEADER_VALUE:
        raise ValueError(f"a header's value is at most {MAX_HEADER_VALUE} characters")
    if _NOT_ONE_LINE.search(value):
        raise ValueError("a line break or control character in a header's value: it is one line")
    return value


HeaderName = Annotated[str, AfterValidator(_header_name)]
HeaderValue = Annotated[str, AfterValidator(_header_value)]


def _one_of_two_bodies(schema: dict[str, Any]) -> None:
    """The JSON schema of EmailPayload's model validator: `html` or `text`, not empty."""
    schema["anyOf"] = [{"required": [name], "properties": {name: {"type": "string", "minLength": 1}}}
                       for name in ("html", "text")]


_ADDRESS_SCHEMA = {"type": "string", "pattern": EMAIL_PATTERN,
                   "description": "an email address, alone or as `Name <address>`"}


_ADDRESSES_SCHEMA = {"anyOf": [_ADDRESS_SCHEMA, {"type": "array", "items": _ADDRESS_SCHEMA,
                                                  "maxItems": MAX_RECIPIENTS}, {"type": "null"}],
                     "description": f"one address, or up to {MAX_RECIPIENTS}"}


# Fields of Resend's `POST /emails` that dispatch does not send: Resend's batch endpoint, which a marketing send may
# go through, takes neither. Refused at once, named, rather than dropped on the way (an invoice delivered without
# its PDF, a campaign for tomorrow sent now, each recorded `delivered`).
UNSENT_EMAIL_FIELDS = {
    "attachments": "dispatch does not send attachments (Resend's batch endpoint takes none): link to the file instead",
    "scheduled_at": "dispatch does not schedule emails (Resend's batch endpoint cannot): publish the send when it "
                    "is due",
}
_UNSENT = Annotated[None, WithJsonSchema({"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 0},
                                                     {"type": "array", "maxItems": 0},
                                                     {"type": "object", "maxProperties": 0}]})]


class EmailPayload(BaseModel):
    """A rendered email, in the shape of Resend's `POST /emails` body (`html` or `text` required)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, json_schema_extra=_one_of_two_bodies)
    from_: Annotated[str, WithJsonSchema(_ADDRESS_SCHEMA)] = Field(alias="from")
    to: Annotated[list[str], WithJsonSchema({"anyOf": [
        _ADDRESS_SCHEMA, {"type": "array", "items": _ADDRESS_SCHEMA, "minItems": 1, "maxItems": MAX_RECIPIENTS}],
        "description": f"one recipient, or 1 to {MAX_RECIPIENTS}"})] = Field(min_length=1, max_length=MAX_RECIPIENTS)
    subject: str = Field(min_length=1, max_length=998, json_schema_extra=ONE_LINE_SCHEMA, description="one line")
    tags: list[Tag] | None = Field(None, max_length=50)
    html: str | None = None
    text: str | None = None
    # Every address field the provider is given is checked as `to` is (no CR or LF reaches a mail header).
    cc: Annotated[list[str] | None, WithJsonSchema(_ADDRESSES_SCHEMA)] = Field(None, max_length=MAX_RECIPIENTS)
    bcc: Annotated[list[str] | None, WithJsonSchema(_ADDRESSES_SCHEMA)] = Field(None, max_length=MAX_RECIPIENTS)
    reply_to: Annotated[list[str] | None, WithJsonSchema(_ADDRESSES_SCHEMA)] = Field(None, max_length=MAX_RECIPIENTS)
    headers: Annotated[dict[HeaderName, HeaderValue] | None, WithJsonSchema(_HEADERS_SCHEMA)] = None
    attachments: _UNSENT = Field(None, description=UNSENT_EMAIL_FIELDS["attachments"])
    scheduled_at: _UNSENT = Field(None, description=UNSENT_EMAIL_FIELDS["scheduled_at"])

    @field_validator(*UNSENT_EMAIL_FIELDS, mode="before")
    @classmethod
    def _not_sent(cls, v: Any, info: ValidationInfo) -> None:
        if v not in (None, "", [], {}):  # an empty one asks for nothing (it was sent without it before too)
            raise ValueError(UNSENT_EMAIL_FIELDS[str(info.field_name)])
        return None

    @field_validator("to", "cc", "bcc", "reply_to", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("from_")
    @classmethod
    def _from(cls, v: str) -> str:
        return check_address(v)

    @field_validator("to", "cc", "bcc", "reply_to")
    @classmethod
    def _to(cls, v: list[str] | None) -> list[str] | None:
        return None if v is None else [check_address(a) for a in v]

    @field_validator("subject")
    @classmethod
    def _one_line(cls, v: str, info: ValidationInfo) -> str:
        if _submitted(info) and _NOT_ONE_LINE.search(v):
            raise ValueError("the subject has a line break or control character: it is one line")
        return v

    @field_validator("headers")
    @classmethod
    def _at_most(cls, v: dict[str, str] | None, info: ValidationInfo) -> dict[str, str] | None:
        if v is not None and _submitted(info) and len(v) > MAX_HEADERS:
            raise ValueError(f"at most {MAX_HEADERS} headers")
        return v

    @model_validator(mode="after")
    def _body(self) -> EmailPayload:
        if not self.html and not self.text:
            raise ValueError("an email needs `html` or `text`")
        return self


class SmsPayload(BaseModel):
    """A rendered SMS."""

    model_config = ConfigDict(extra="allow")
    to: str = Field(pattern=_E164.pattern, description="E.164 number, e.g. +14155550123")
    body: str = Field(min_length=1, max_length=1600)


class WebhookPayload(BaseModel):
    """An event for the tenant's webhook endpoints: each enabled endpoint subscribed to `event_type`
    gets its own delivery of `{"id", "type", "timestamp", "data"}`."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    event_type: str = Field(pattern=EVENT_TYPE_PATTERN, description="e.g. invoice.paid")
    occurred_at: str = Field(alias="occurredAt", title="occurredAt", json_schema_extra={"format": "date-time"},
                             description="when it happened (RFC 3339; other ISO 8601 forms are accepted too); "
                                         "receivers order by it")
    data: dict[str, Any]

    @field_validator("occurred_at")
    @classmethod
    def _iso(cls, v: str) -> str:
        if is_rfc3339(v):
            return v
        try:
            datetime.fromisoformat(v.replace("Z", "+00:00"))
        except ValueError:
            raise ValueError("occurredAt must be an ISO 8601 date and time") from None
        return v


def is_rfc3339(value: str) -> bool:
    """An RFC 3339 date-time, as JSON Schema's `date-time` format means it: year 0000 to 9999, `T`/`t`,
    `Z`/`z`, any fraction, and second 60 (a leap second; not checked against the leap-second table)."""
    m = _RFC3339.fullmatch(value)
    if m is None:
        return False
    year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
    offset_hour, offset_minute = (int(g) for g in m.groups()[6:]) if m.group(7) else (0, 0)
    leap = year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
    days = (31, 29 if leap else 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)
    return (1 <= month <= 12 and 1 <= day <= days[month - 1] and hour <= 23 and minute <= 59 and second <= 60
            and offset_hour <= 23 and offset_minute <= 59)


PAYLOADS: dict[str, type[BaseModel]] = {"email": EmailPayload, "sms": SmsPayload, "webhook": WebhookPayload}

_TEMPLATE_ID = "the template the payload was rendered from"
_POLICY = ("named retry policy; when absent, chosen by template and category (see streams/retry/policies.toml, "
           "[routing])")


# The OpenAPI's view of a send, one model per channel (documentation only: SendRequest validates). A
# request that fits one of them is one SendRequest accepts; the API narrows `policy` to its policy names.
class EmailSend(BaseModel):
    """An email send."""

    channel: Literal["email"]
    category: Category
    template_id: Ident = Field(description=_TEMPLATE_ID)
    template_version: Ident
    payload: EmailPayload
    policy: Ident | None = Field(None, description=_POLICY)
    correlation_id: Ident | None = None


class SmsSend(BaseModel):
    """An SMS send."""

    channel: Literal["sms"]
    category: Category
    template_id: Ident = Field(description=_TEMPLATE_ID)
    template_version: Ident
    payload: SmsPayload
    policy: Ident | None = Field(None, description=_POLICY)
    correlation_id: Ident | None = None


class WebhookSend(BaseModel):
    """A webhook event, delivered to each of the tenant's endpoints subscribed to its type."""

    channel: Literal["webhook"]
    category: Category
    template_id: Ident | None = Field(None, description="default: the event type")
    template_version: Ident | None = Field(None, description="default: 1")
    payload: WebhookPayload
    policy: Ident | None = Field(None, description=_POLICY)
    correlation_id: Ident | None = None


SEND_VARIANTS: dict[str, type[BaseModel]] = {"email": EmailSend, "sms": SmsSend, "webhook": WebhookSend}
_SEND_SCHEMA = TypeAdapter(Annotated[EmailSend | SmsSend | WebhookSend, Field(discriminator="channel")])


class SendRequest(BaseModel):
    """What a producer submits. The tenant is not here: it comes from the credential."""

    model_config = ConfigDict(extra="ignore")
    channel: Channel
    category: Category
    template_id: Ident | None = Field(None, description="required for email and sms; webhooks default to the "
                                                        "event type")
    template_version: Ident | None = Field(None, description="required for email and sms")
    payload: dict[str, Any]
    policy: Ident | None = Field(None, description="named retry policy; when absent, chosen by template "
                                                   "and category (see streams/retry/policies.toml, [routing])")
    correlation_id: Ident | None = None

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        """Published as one of EmailSend, SmsSend and WebhookSend, by `channel`: each with its exact payload."""
        return {**handler(_SEND_SCHEMA.core_schema), "title": cls.__name__, "description": cls.__doc__}

    @model_validator(mode="after")
    def _payload_matches_channel(self) -> SendRequest:
        if nested_deeper_than(self.payload, MAX_PAYLOAD_DEPTH):
            # Refused here, named: serialized later (for the event, the Idempotency-Key's digest) it failed as a 500.
            raise PayloadError([{"loc": ("payload",), "msg": f"nested deeper than {MAX_PAYLOAD_DEPTH} levels"}])
        if self.channel == "email" and "from_" in self.payload:
            # The other accepted spelling of `from`, published as `from`: the provider reads `from` only.
            self.payload.setdefault("from", self.payload.pop("from_"))
        if self.channel == "webhook":
            self.template_id = self.template_id or str(self.payload.get("event_type", "webhook"))[:128]
            self.template_version = self.template_version or "1"
        elif self.template_id is None or self.template_version is None:
            raise ValueError(f"a {self.channel} send needs template_id and template_version")
        try:
            PAYLOADS[self.channel].model_validate(self.payload)
        except ValidationError as exc:
            # Re-raise under `payload.<field>` so the caller sees where.
            raise PayloadError([{"loc": ("payload", *e["loc"]), "msg": e["msg"]} for e in exc.errors()]) from None
        return self


class Send(BaseModel):
    """The event on a lane topic (schema version 1)."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    v: Literal[1]
    send_id: SendId
    tenant_id: TenantId
    channel: Channel
    category: Category
    lane: Lane
    policy: Ident
    template_id: Ident
    template_version: Ident
    payload: dict[str, Any]
    created_at_ms: int
    correlation_id: str | None = None
    replay_of: SendId | None = None  # a replay is a new send (new id); this is the send it replays

    @model_validator(mode="after")
    def _lane_follows_category(self) -> Send:
        if self.lane != lane_for(self.category):
            raise ValueError(f"a {self.category} send travels in the {lane_for(self.category)} lane, not {self.lane}")
        return self


# The events are JSON encoded by orjson, which carries integers from -2^63 to 2^64-1, finite numbers and strings of
# Unicode scalar values (no unpaired surrogate): a payload holding anything else is refused, and said so (orjson
# refuses the first two kinds with a bare TypeError, and writes NaN and infinity as null, silently).
INTEGERS = (-(2**63), 2**64 - 1)


def uncarried(value: object, path: tuple[str | int, ...] = ()) -> tuple[tuple[str | int, ...], str] | None:
    """The first value in `value` the events cannot carry, with where and why (None when there is none)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else (path, "NaN or an infinity is no JSON number: send it as a string")
    if isinstance(value, int):
        return None if INTEGERS[0] <= value <= INTEGERS[1] else (path, "an integer outside -2^63 .. 2^64-1 cannot "
                                                                      "be carried: send it as a string")
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return path, "a string with an unpaired surrogate (\\ud800-\\udfff) cannot be carried"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and (found := uncarried(key, path)):
            return found
        if found := uncarried(item, (*path, key)):
            return found
    return None


def uncarried_errors(payloads: Sequence[dict], where: Callable[[int], list]) -> list[dict]:
    """A field error for each payload holding a value the events cannot carry, at `where(i)` + its path. A
    payload's keys may be addresses or numbers (a map by recipient): named redacted, as every validation error
    names them."""
    errors = []
    for i, payload in enumerate(payloads):
        if (found := uncarried(payload)) is not None:
            path, msg = found
            errors.append({"loc": [*where(i), *(redact(k, 100) if isinstance(k, str) else k for k in path)],
                           "msg": msg})
    return errors


def flatten_errors(errors: Sequence[Any], prefix: tuple = ()) -> list[dict]:
    """Pydantic error dicts as [{loc, msg}], with payload errors unwrapped to their own field."""
    out: list[dict] = []
    for e in errors:
        nested = (e.get("ctx") or {}).get("error")
        if isinstance(nested, PayloadError):
            out.extend({"loc": (*prefix, *e["loc"], *x["loc"]), "msg": x["msg"]} for x in nested.errors)
        elif e.get("type") == "json_invalid" and nested:  # "JSON decode error", then what the parser met
            out.append({"loc": (*prefix, *e["loc"]), "msg": f"{e['msg']}: {nested}"})
        else:
            out.append({"loc": (*prefix, *e["loc"]), "msg": e["msg"]})
    return out


def validate_request(raw: dict, known_policies: frozenset[str] | None = None) -> SendRequest:
    """Validate one submitted send; raises SendValidationError with field-level errors."""
    return validate_batch([raw], known_policies, prefix=False)[0]


def validate_batch(raws: list, known_policies: frozenset[str] | None = None,
                   prefix: bool = True) -> list[SendRequest]:
    """Validate every send; any error rejects the whole batch (errors carry the index)."""
    errors: list[dict] = []
    out: list[SendRequest] = []
    for i, raw in enumerate(raws):
        where = (i,) if prefix else ()
        if not isinstance(raw, dict):
            errors.append({"loc": where, "msg": "a send must be a JSON object"})
            continue
        try:
            req = SendRequest.model_validate(raw)
        except ValidationError as exc:
            errors.extend(flatten_errors(exc.errors(), where))
            continue
        problem = policy_error(req, known_policies, where)
        if problem:
            errors.append(problem)
            continue
        out.append(req)
    if errors:
        raise SendValidationError(errors)
    return out


def policy_error(req: SendRequest, known_policies: frozenset[str] | None, where: tuple) -> dict | None:
    """The field error of a send naming a retry policy the policy file does not define."""
    if known_policies is None or req.policy is None or req.policy in known_policies:
        return None
    return {"loc": (*where, "policy"), "msg": unknown_policy(req.policy, known_policies)}


def check_tenant_id(tenant_id: str) -> str:
    """A tenant id travels as a provider tag: ASCII letters, digits, `_` and `-` only (<= 64)."""
    if not re.fullmatch(TENANT_ID_PATTERN, tenant_id or ""):
        raise SendValidationError([{"loc": ("tenant_id",), "msg": "a tenant id holds 1 to 64 ASCII letters, digits, "
                                                                 "'_' or '-' (it travels as a provider tag)"}])
    return tenant_id


def build_send(req: SendRequest, tenant_id: str, now_ms: int | None = None,
               routing: PolicyRouting | None = None, send_id: str | None = None) -> Send:
    """Freeze a validated request into the event: assign the send id, the lane and the policy (the
    request's own, else the routing's choice for its template and category)."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    template_id, template_version = req.template_id or "webhook", req.template_version or "1"  # set by validation
    policy = req.policy or (routing or default_routing()).policy_for(req.channel, req.category, template_id)
    return Send(
        v=SCHEMA_VERSION, send_id=send_id or new_send_id(now), tenant_id=check_tenant_id(tenant_id),
        channel=req.channel, category=req.category, lane=lane_for(req.category), policy=policy,
        template_id=template_id, template_version=template_version, payload=req.payload,
        created_at_ms=now, correlation_id=req.correlation_id,
    )


def encode(send: Send) -> bytes:
    return orjson.dumps(send.model_dump(mode="json"))


# Send ids are UUIDs (36 characters); a longer one read from a record dispatch did not write is none.
MAX_SEND_ID_BYTES = 64


def plausible_send_id(raw: bytes | None) -> bytes:
    """`raw`, a send id read from a record that may not be a send's (a header), when it can be one (b"" when
    not): it keys and heads a dead letter, which a megabyte's "id" would make one the broker refuses for ever."""
    return raw if raw and len(raw) <= MAX_SEND_ID_BYTES else b""


def peek_send_id(value: bytes | None) -> bytes:
    """The send id of an event that may not decode as a send (b"" when it names none, or none that can be one):
    for its dead letter."""
    try:
        doc = orjson.loads(value or b"")
    except orjson.JSONDecodeError:
        return b""
    return plausible_send_id(str(doc.get("send_id", "")).encode()) if isinstance(doc, dict) else b""


def decode(value: bytes | None) -> Send:
    """Parse an event from a lane topic; raises MalformedEvent(reason) when it cannot be used."""
    if not value:
        raise MalformedEvent("malformed", "empty message value")
    try:
        doc = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise MalformedEvent("malformed", f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise MalformedEvent("malformed", "not a JSON object")
    if doc.get("v") != SCHEMA_VERSION:
        raise MalformedEvent("unknown_version", f"schema version {doc.get('v')!r} is not supported "
                                                f"(this worker reads {SCHEMA_VERSION})")
    category, lane = doc.get("category"), doc.get("lane")
    if isinstance(category, str) and category in CATEGORY_TO_LANE and lane != lane_for(category):
        # The lane is derived from the category; an event that says otherwise is not trusted.
        raise MalformedEvent("lane_violation", f"a {category} send labelled lane {lane!r}")
    try:
        send = Send.model_validate(doc)
    except ValidationError as exc:
        raise MalformedEvent("malformed", format_field_errors(exc.errors())) from None
    try:
        PAYLOADS[send.channel].model_validate(send.payload, context={ACCEPTED_EARLIER: True})
    except ValidationError as exc:  # a send whose payload is refused: carried, so its status says dead-lettered
        raise MalformedEvent("malformed", format_field_errors(exc.errors()), send) from None
    return send
