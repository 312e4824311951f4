"""`streams mock-provider`: a real HTTP server standing for the outside world (Resend + an SMS gateway).

- One team-wide limit shared by every API key (requests/s); beyond it: 429 with `ratelimit-*` and
  `retry-after` headers and Resend's error body. `POST /_mock/config {"throttle_all_for_s": N}`
  answers 429 to everything for N seconds.
- `POST /emails`, `POST /emails/batch` (1..100, strict: one invalid email fails the batch, no
  attachments or scheduled_at), `POST /sms/messages`.
- A second SMS protocol with short-lived tokens: `POST /oauth/token` (client credentials) issues
  HS256 JWTs that live `token_ttl_s` (30 s; settable), `POST /v2/messages` answers 401 to an expired,
  revoked (`revoke_tokens`) or forged token. Start a second instance to stand for a second provider.
- Resend API keys: none gets 401 `missing_api_key`; a key not starting with `re_` (no key at all) 400
  `validation_error` "API key is invalid", as Resend answers it (the SMS gateway: 401); one of
  `revoked_api_keys` (comma-separated) 403 `invalid_api_key`, Resend's answer for a key deleted from the
  dashboard.
- SMS rules for fallback tests: `sms_no_id_ratio` answers 200 without a message id;
  destinations starting with one of `sms_unsupported_prefixes` get 400 `unsupported_destination`,
  with one of `sms_invalid_prefixes` 400 `invalid_recipient` (a business rule).
- Idempotency keys kept 24 h per account (an API key; for tokens, the client they were issued to): same
  key and body -> the same response again (not a new delivery); a different body -> 409
  `invalid_idempotent_request`.
- Faults: latency, a 5xx ratio, a ratio of timeouts *after* accepting (the message counts as
  delivered, the answer comes too late), a 401 ratio, and `hold_answers` (accept, then hold every
  answer until it is switched off; `held` in the stats counts them). `hold_answers_after` N does the
  same for every request accepted once N messages have been delivered (a test's cut at an exact
  point, with no race against a fast worker); 0 turns it off.
- `GET /_mock/stats`: per-tenant counts, per-send receive times (`?deliveries=1`), duplicate
  deliveries, forbidden requests, the last 1,000 emails (`?messages=1`: send id, tenant, to,
  subject, text). Any other path (audiences, contacts, segments, broadcasts, topics ...) is refused,
  counted and logged as an error.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import random
import re
import time
import uuid
from dataclasses import dataclass, field

import jwt
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

log = logging.getLogger("streams.mock_provider")
_EMAIL = re.compile(r"^([^<>]*<)?[^@\s<>]+@[^@\s<>]+\.[^@\s<>]+>?$")
_E164 = re.compile(r"^\+[1-9]\d{6,14}$")
_TAG = re.compile(r"^[A-Za-z0-9_-]{1,256}$")  # Resend's rule for tag names and values
IDEMPOTENCY_TTL_S = 24 * 3600
MESSAGES_KEPT = 1000
TOKEN_SECRET = "mock-provider-token-signing-secret"  # noqa: S105 - a mock's own key
CLIENT = ("mock-client", "mock-secret")  # the client credentials the token endpoint accepts


def _json(body: object, status: int = 200, headers: dict | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, headers=headers,
                    media_type="application/json")


def _error(status: int, name: str, message: str, headers: dict | None = None) -> Response:
    return _json({"statusCode": status, "name": name, "message": message}, status, headers)


def _b_error(status: int, code: str, message: str) -> Response:
    """The second SMS protocol's error shape."""
    return _json({"error": {"code": code, "message": message}}, status)


def _prefixes(raw: str) -> list[str]:
    return [p.strip() for p in raw.split(",") if p.strip()]


@dataclass
class MockConfig:
    rate: float = 10.0               # team-wide requests per second
    latency_ms: float = 0.0
    fault_5xx_ratio: float = 0.0     # 500 before accepting (the worker cannot tell: an unknown outcome)
    fault_408_ratio: float = 0.0     # 408 before reading the body (never acted on: retried, released)
    fault_timeout_ratio: float = 0.0
    timeout_delay_s: float = 15.0    # how late a "timed out" answer comes
    fault_401_ratio: float = 0.0
    hold_answers: bool = False       # accept requests, then hold every answer until released
    hold_answers_after: float = 0.0  # > 0: as hold_answers, for requests accepted past this many messages
    fault_502_after_accept_ratio: float = 0.0  # accept (deliver), then answer 502 as a gateway that lost it
    token_ttl_s: float = 30.0        # lifetime of the tokens /oauth/token issues
    revoke_tokens: bool = False      # set: every token issued so far is refused (a forced 401)
    sms_no_id_ratio: float = 0.0     # 200 without a message id (the message was not taken)
    sms_unsupported_prefixes: str = ""  # comma-separated: 400 unsupported_destination
    sms_invalid_prefixes: str = ""      # comma-separated: 400 invalid_recipient (a business rule)
    revoked_api_keys: str = ""          # comma-separated: 403 invalid_api_key (a key deleted at the provider)
    seed: int | None = None


@dataclass
class MockState:
    config: MockConfig
    tokens: float = 0.0
    updated: float = field(default_factory=time.monotonic)
    throttle_until: float = 0.0
    idempotency: dict = field(default_factory=dict)   # (account, key) -> (expires, body_hash, status, body)
    in_flight_keys: set = field(default_factory=set)
    deliveries: dict = field(default_factory=dict)    # send_id -> [receive unix times]
    tenants: dict = field(default_factory=dict)       # tenant -> counters
    counts: dict = field(default_factory=lambda: {
        "requests_total": 0, "throttled": 0, "forbidden": 0, "faults_5xx": 0, "faults_408": 0, "faults_timeout": 0,
        "faults_401": 0, "faults_502_after_accept": 0, "rejected": 0, "idempotent_replays": 0,
        "idempotency_conflicts": 0,
        "single_email_requests": 0, "batch_email_requests": 0, "sms_requests": 0, "token_requests": 0,
        "token_refused_401": 0, "api_keys_refused_403": 0, "sms_no_id": 0, "sms_unsupported": 0, "sms_invalid": 0,
        "marketing_single_requests": 0, "messages_delivered": 0})
    forbidden_paths: list = field(default_factory=list)
    revoked_before: float = 0.0                       # tokens issued before this are refused
    messages: list = field(default_factory=list)      # the last emails delivered: send_id, tenant, to, subject
    held: int = 0                                     # accepted requests whose answer is held
    release: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.tokens = self.config.rate
        self.rng = random.Random(self.config.seed)

    def take_token(self) -> tuple[bool, float]:
        now = time.monotonic()
        if now < self.throttle_until:
            return False, self.throttle_until - now
        rate = self.config.rate
        self.tokens = min(rate, self.tokens + (now - self.updated) * rate)
        self.updated = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True, 0.0
        return False, (1 - self.tokens) / rate

    def tenant(self, name: str) -> dict:
        return self.tenants.setdefault(name, {"requests": 0, "messages": 0, "single_requests": 0,
                                              "batch_requests": 0, "throttled": 0})


def _tags(item: dict) -> dict[str, str]:
    tags = item.get("tags") or []
    return {str(t.get("name")): str(t.get("value")) for t in tags if isinstance(t, dict)}


def _validate_email(item: object, where: str, in_batch: bool) -> str | None:
    if not isinstance(item, dict):
        return f"{where}: must be an object"
    if in_batch and ("attachments" in item or "scheduled_at" in item):
        return f"{where}: attachments and scheduled_at are not supported in batch emails"
    for tag in item.get("tags") or []:
        if not isinstance(tag, dict) or not all(isinstance(tag.get(k), str) and _TAG.match(tag[k])
                                                for k in ("name", "value")):
            return f"{where}: tags should only contain ASCII letters, numbers, underscores, or dashes"
    if not isinstance(item.get("from"), str) or not _EMAIL.match(item["from"]):
        return f"{where}: invalid `from` field"
    to = item.get("to")
    to = [to] if isinstance(to, str) else to
    if not isinstance(to, list) or not 1 <= len(to) <= 50 \
            or not all(isinstance(a, str) and _EMAIL.match(a) for a in to):
        return f"{where}: invalid `to` field (1 to 50 addresses)"
    if not isinstance(item.get("subject"), str) or not item["subject"]:
        return f"{where}: missing `subject` field"
    if not item.get("html") and not item.get("text"):
        return f"{where}: missing `html` or `text` field"
    return None


async def hold(state: MockState) -> None:
    """Keep an accepted request's answer until `hold_answers` is switched off (tests kill a worker
    while it waits, so the request's outcome is unknown to it but the provider has accepted it)."""
    state.held += 1
    try:
        await state.release.wait()
    finally:
        state.held -= 1


def build_app(config: MockConfig) -> Starlette:
    state = MockState(config)

    async def guarded(request: Request, kind: str) -> Response:
        """Auth, idempotency and limits shared by every send endpoint."""

        def err(status: int, name: str, message: str, headers: dict | None = None) -> Response:
            if kind == "sms_b":
                return _json({"error": {"code": name, "message": message}}, status, headers)
            return _error(status, name, message, headers)

        c = state.counts
        c["requests_total"] += 1
        if config.latency_ms:
            await asyncio.sleep(config.latency_ms / 1000)
        auth = request.headers.get("authorization", "")
        api_key = auth.removeprefix("Bearer ").strip()
        if kind == "sms_b":
            refusal = token_refusal(api_key)
            if refusal:
                c["token_refused_401"] += 1
                return _b_error(401, refusal, "the access token is not valid")
        elif not api_key:
            return err(401, "missing_api_key", "Missing API key in the authorization header.")
        elif not api_key.startswith("re_"):  # as Resend answers a header that is no key at all (401: the SMS gateway)
            return err(401 if kind == "sms" else 400, "validation_error" if kind != "sms" else "invalid_api_key",
                       "API key is invalid")
        elif state.rng.random() < config.fault_401_ratio:
            c["faults_401"] += 1
            return err(401, "validation_error", "API key is invalid")
        elif api_key in _prefixes(config.revoked_api_keys):
            c["api_keys_refused_403"] += 1
            return err(403, "invalid_api_key", "API key is invalid")
        ok, wait = state.take_token()
        if not ok:
            c["throttled"] += 1
            reset = max(1, math.ceil(wait))
            return err(429, "rate_limit_exceeded",
                          f"Too many requests. You can only make {config.rate:g} requests per second.",
                          {"ratelimit-limit": f"{config.rate:g}", "ratelimit-remaining": "0",
                           "ratelimit-reset": str(reset), "retry-after": str(reset)})
        if config.fault_408_ratio and state.rng.random() < config.fault_408_ratio:  # no draw when off (seeded runs)
            c["faults_408"] += 1
            return err(408, "request_timeout", "The request body did not arrive in time.")
        raw = await request.body()
        key = request.headers.get("idempotency-key")
        digest = hashlib.sha256(raw).hexdigest()
        now = time.time()
        # Idempotency keys are the account's, as providers scope them (Stripe, Resend): with short-lived tokens,
        # the client the token was issued to, so a request sent again after its token was refreshed is the same.
        account = token_subject(api_key) if kind == "sms_b" else api_key
        if key:
            seen = state.idempotency.get((account, key))
            if seen and seen[0] > now:
                if seen[1] != digest:
                    c["idempotency_conflicts"] += 1
                    return err(409, "invalid_idempotent_request",
                                  "Same idempotency key used with a different request payload.")
                c["idempotent_replays"] += 1
                return _json(seen[3], 201 if kind == "sms_b" and seen[2] == 200 else seen[2])  # as it first answered
            if (account, key) in state.in_flight_keys:
                return err(409, "concurrent_idempotent_requests",
                              "Same idempotency key used while the original request is still in progress.")
        if state.rng.random() < config.fault_5xx_ratio:
            c["faults_5xx"] += 1
            return err(500, "internal_server_error", "An unexpected error occurred.")
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            c["rejected"] += 1
            return err(422, "validation_error", "Invalid JSON body.")
        if key:
            state.in_flight_keys.add((account, key))
        try:
            status, answer = accept(kind, body)
            if key and status == 200:
                state.idempotency[(account, key)] = (now + IDEMPOTENCY_TTL_S, digest, status, answer)
            if status == 200 and state.rng.random() < config.fault_502_after_accept_ratio:
                c["faults_502_after_accept"] += 1
                return err(502, "bad_gateway", "The upstream answer was lost.")
            past_cut = 0 < config.hold_answers_after < state.counts["messages_delivered"]
            if status == 200 and (config.hold_answers or past_cut):
                await hold(state)
            if status == 200 and state.rng.random() < config.fault_timeout_ratio:
                c["faults_timeout"] += 1
                await asyncio.sleep(config.timeout_delay_s)  # accepted, but the answer comes too late
            if kind == "sms_b" and status != 200 and isinstance(answer, dict):
                return err(status, answer["name"], answer["message"])
            return _json(answer, 201 if kind == "sms_b" and status == 200 else status)
        finally:
            if key:
                state.in_flight_keys.discard((account, key))

    def token_subject(token: str) -> str:
        """The client a good token was issued to."""
        return str(jwt.decode(token, TOKEN_SECRET, algorithms=["HS256"], options={"verify_exp": False})["sub"])

    def token_refusal(token: str) -> str | None:
        """Why a bearer token is refused (None: it is good)."""
        try:
            claims = jwt.decode(token, TOKEN_SECRET, algorithms=["HS256"])
        except jwt.ExpiredSignatureError:
            return "token_expired"
        except jwt.PyJWTError:
            return "invalid_token"
        if claims.get("iat_ms", 0) / 1000 < state.revoked_before or state.rng.random() < config.fault_401_ratio:
            return "token_revoked"
        return None

    def deliver(items: list[dict], kind: str) -> None:
        now = time.time()
        for item in items:
            tags = _tags(item)
            tenant = state.tenant(tags.get("tenant", "unknown"))
            tenant["messages"] += 1
            state.counts["messages_delivered"] += 1
            if tags.get("send_id"):
                state.deliveries.setdefault(tags["send_id"], []).append(now)
            if "subject" in item:
                state.messages.append({"send_id": tags.get("send_id"), "tenant": tags.get("tenant"),
                                       "to": item.get("to"), "subject": item["subject"], "text": item.get("text")})
                del state.messages[:-MESSAGES_KEPT]
        tags = _tags(items[0])
        tenant = state.tenant(tags.get("tenant", "unknown"))
        tenant["requests"] += 1
        tenant["batch_requests" if kind == "batch" else "single_requests"] += 1
        if kind == "single" and tags.get("lane") == "marketing":
            state.counts["marketing_single_requests"] += 1

    def accept(kind: str, body: object) -> tuple[int, object]:
        c = state.counts
        if kind == "batch":
            if not isinstance(body, list) or not 1 <= len(body) <= 100:
                c["rejected"] += 1
                return 422, {"statusCode": 422, "name": "validation_error",
                             "message": "A batch holds 1 to 100 emails."}
            for i, item in enumerate(body):
                problem = _validate_email(item, f"emails[{i}]", in_batch=True)
                if problem:
                    c["rejected"] += 1
                    return 422, {"statusCode": 422, "name": "validation_error", "message": problem}
            c["batch_email_requests"] += 1
            deliver(body, "batch")
            return 200, {"data": [{"id": str(uuid.uuid4())} for _ in body]}
        if kind == "single":
            problem = _validate_email(body, "email", in_batch=False)
            if problem or not isinstance(body, dict):
                c["rejected"] += 1
                return 422, {"statusCode": 422, "name": "validation_error", "message": problem}
            c["single_email_requests"] += 1
            deliver([body], "single")
            return 200, {"id": str(uuid.uuid4())}
        if kind == "sms_b" and isinstance(body, dict):  # the second protocol's shape, as the first's
            body = {"to": body.get("destination"), "body": body.get("text"),
                    "tags": [{"name": k, "value": v} for k, v in (body.get("metadata") or {}).items()]}
        if not isinstance(body, dict) or not _E164.match(str(body.get("to", ""))) or not body.get("body"):
            c["rejected"] += 1
            return 422, {"statusCode": 422, "name": "validation_error", "message": "invalid `to` or `body`"}
        to = str(body["to"])
        if any(to.startswith(p) for p in _prefixes(config.sms_unsupported_prefixes)):
            c["sms_unsupported"] += 1
            return 400, {"statusCode": 400, "name": "unsupported_destination",
                         "message": "this destination is not one we recognise"}
        if any(to.startswith(p) for p in _prefixes(config.sms_invalid_prefixes)):
            c["sms_invalid"] += 1
            return 400, {"statusCode": 400, "name": "invalid_recipient", "message": "the recipient is not valid"}
        if state.rng.random() < config.sms_no_id_ratio:
            c["sms_no_id"] += 1
            return 200, ({"message": {}} if kind == "sms_b" else {"status": "queued"})  # nothing taken
        c["sms_requests"] += 1
        deliver([body], "sms")
        message_id = str(uuid.uuid4())
        return 200, ({"message": {"sid": "SM" + message_id.replace("-", "")}} if kind == "sms_b"
                     else {"id": message_id})

    async def emails(request: Request) -> Response:
        return await guarded(request, "single")

    async def emails_batch(request: Request) -> Response:
        return await guarded(request, "batch")

    async def sms(request: Request) -> Response:
        return await guarded(request, "sms")

    async def sms_b(request: Request) -> Response:
        return await guarded(request, "sms_b")

    async def token(request: Request) -> Response:
        state.counts["token_requests"] += 1
        try:
            doc = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            doc = None
        if not isinstance(doc, dict) or (doc.get("client_id"), doc.get("client_secret")) != CLIENT:
            return _b_error(401, "invalid_client", "unknown client credentials")
        now = time.time()
        value = jwt.encode({"sub": doc["client_id"], "iat": int(now), "iat_ms": int(now * 1000),
                            "exp": now + config.token_ttl_s, "jti": uuid.uuid4().hex}, TOKEN_SECRET,
                           algorithm="HS256")
        return _json({"access_token": value, "token_type": "Bearer", "expires_in": int(config.token_ttl_s)})

    async def stats(request: Request) -> Response:
        dup = {k: len(v) for k, v in state.deliveries.items() if len(v) > 1}
        body = {**state.counts, "held": state.held, "tenants": state.tenants,
                "distinct_sends": len(state.deliveries),
                "duplicate_deliveries": sum(n - 1 for n in dup.values()), "duplicated_sends": dup,
                "forbidden_paths": state.forbidden_paths[-50:]}
        if request.query_params.get("deliveries") == "1":
            body["deliveries"] = state.deliveries
        if request.query_params.get("messages") == "1":
            body["messages"] = state.messages
        return _json(body)

    async def configure(request: Request) -> Response:
        change = orjson.loads(await request.body() or b"{}")
        for key, value in change.items():
            if key == "throttle_all_for_s":
                state.throttle_until = time.monotonic() + float(value)
            elif key == "revoke_tokens":
                state.revoked_before = time.time()
            elif key == "hold_answers":
                config.hold_answers = bool(value)
                if not value:  # answer everything held so far
                    state.release.set()
                    state.release = asyncio.Event()
            elif hasattr(config, key):
                current = getattr(config, key)
                if isinstance(current, bool | str):
                    setattr(config, key, type(current)(value))
                else:  # numbers (and the unset seed)
                    setattr(config, key, float(value) if value is not None else None)
            else:
                return _error(422, "validation_error", f"unknown mock setting {key!r}")
        return _json({"config": config.__dict__})

    async def reset(request: Request) -> Response:
        nonlocal state
        state = MockState(config)
        return _json({"reset": True})

    async def forbidden(request: Request) -> Response:
        state.counts["forbidden"] += 1
        state.forbidden_paths.append(f"{request.method} {request.url.path}")
        log.error("FORBIDDEN provider path requested: %s %s", request.method, request.url.path)
        return _error(404, "forbidden_path", f"{request.method} {request.url.path} is not allowed here")

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE"]
    return Starlette(routes=[
        Route("/emails", emails, methods=["POST"]),
        Route("/emails/batch", emails_batch, methods=["POST"]),
        Route("/sms/messages", sms, methods=["POST"]),
        Route("/v2/messages", sms_b, methods=["POST"]),
        Route("/oauth/token", token, methods=["POST"]),
        Route("/_mock/stats", stats, methods=["GET"]),
        Route("/_mock/config", configure, methods=["POST"]),
        Route("/_mock/reset", reset, methods=["POST"]),
        Route("/{path:path}", forbidden, methods=methods),
    ])


def serve(host: str, port: int, config: MockConfig) -> None:
    import uvicorn

    uvicorn.run(build_app(config), host=host, port=port, log_level="warning", access_log=False)
