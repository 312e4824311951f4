"""What every route of the ingest API shares: one error shape, documented status codes, the body
size limit, OPTIONS answered for every path, and authentication.

Every error is `{"error": <code>, "errors": [{"loc": [...], "msg": ...}]}` (ErrorBody), whatever
answered it: validation, authentication, a missing resource, a quota, the broker. Two fields are added
only where an answer needs them: `outcome` (a 503 that may not mean "nothing was changed", or a keyed retry's
refusal when an earlier attempt under its key may have been published) and
`replayed` (a bulk replay that stopped part way).
"""


import logging
import re
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

import orjson
from fastapi import Depends, FastAPI, HTTPException, Request, Security
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema
from starlette.concurrency import run_in_threadpool
from starlette.routing import Match

from .. import metrics
from ..errors import PublishError, PublishOutcomeUnknown, StackError, StoreUnavailable
from ..state.guard import UNREADABLE_LOG_EVERY_S, StateGuard
from .api_keys import ApiKeys, Principal

log = logging.getLogger("streams.api")


def _no_default(schema: dict[str, Any]) -> None:
    schema.pop("default", None)


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")
    loc: list[str | int]
    msg: str


class ReplayedDelivery(BaseModel):
    delivery_id: str = Field(description="the new delivery (a new webhook-id)")
    replay_of: str


class ErrorBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    error: str
    errors: list[ErrorDetail]
    # Absent unless said: never null in an answer, so the OpenAPI offers neither null nor a default.
    outcome: Literal["unknown", "applied"] | SkipJsonSchema[None] = Field(None, description=(
        "only on a 503 that may not mean \"nothing was changed\", or on a refusal (413, 422, 429) of a retry whose "
        "earlier attempt under its Idempotency-Key may have been published: `unknown`, the request may have taken "
        "effect (retry it with the same Idempotency-Key, or look the named id up first); `applied`, the "
        "change was made but is not yet on the audit trail"), json_schema_extra=_no_default)
    replayed: list[ReplayedDelivery] | SkipJsonSchema[None] = Field(None, description=(
        "only when a bulk endpoint replay stopped part way: what this call had replayed (calling again goes on "
        "from there; a delivery is never replayed twice)"), json_schema_extra=_no_default)


DESCRIPTIONS = {
    400: "the body is not JSON", 401: "no valid API key", 403: "the key's role may not do this",
    404: "no such resource for this tenant", 409: "a request with this Idempotency-Key is still in progress",
    410: "gone: the payload has expired (payloads are kept 7 days)",
    413: "the body, or one send in it, is too large", 422: "invalid: each error names its field",
    429: "over a quota (see Retry-After)",
    503: "a dependency is unavailable (see Retry-After): nothing was changed, unless the body's \"outcome\" "
         "says otherwise (\"unknown\": it may have been; \"applied\": it was, not yet on the audit trail); a bulk "
         "replay lists in \"replayed\" what it had replayed before it stopped",
    500: "an unexpected failure (logged): the request may have taken effect (\"outcome\": \"unknown\"); retry "
         "a send with the same Idempotency-Key, look at the result of anything else before repeating it",
}


def documented(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The error answers a route can give, for the OpenAPI (401 and 403 come with every authenticated route).
    400 and 413 need not be listed: `finish_openapi` adds them where the app answers them."""
    return {code: {"model": ErrorBody, "description": DESCRIPTIONS[code]} for code in codes}


def _error_response(code: int) -> dict[str, Any]:
    return {"description": DESCRIPTIONS[code],
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}}


def finish_openapi(schema: dict[str, Any]) -> dict[str, Any]:
    """Make the document say what every route answers, in the one error shape:

    - FastAPI adds a 422 in its own shape (`HTTPValidationError`) to every route with parameters; the app
      answers ErrorBody, and only where a route lists 422 itself can one happen: FastAPI's goes;
    - every route with a JSON body answers 400 on a body that is not JSON;
    - every POST, PUT and PATCH answers 413 over the body limit (BodyLimit, before any route);
    - every route answers 500, in the same shape, on a failure nobody expected (`internal_error`)."""
    for methods in schema.get("paths", {}).values():
        for method, operation in methods.items():
            responses = operation.setdefault("responses", {})
            if "HTTPValidationError" in str(responses.get("422", "")):
                del responses["422"]
            if "requestBody" in operation:
                responses.setdefault("400", _error_response(400))
            if method in ("post", "put", "patch"):
                responses.setdefault("413", _error_response(413))
            responses.setdefault("500", _error_response(500))
            operation["responses"] = dict(sorted(responses.items()))
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    return schema


def internal_error(request: Request, exc: Exception) -> JSONResponse:
    """The answer to a failure nobody expected, in the one error shape: never the failure's own text (it
    can name internal hosts or carry a payload), and `outcome: unknown`, as it may have happened after
    a publish or a change. The server logs the failure itself, with its traceback."""
    return JSONResponse({"error": "internal_error", "outcome": "unknown", "errors": [{"loc": [], "msg": (
        f"{request.method} {request.url.path} failed unexpectedly (logged); it may have taken effect: retry a send "
        "with the same Idempotency-Key, look at the result of anything else before repeating it")}]}, 500)


def problem(status: int, error: str, loc: list[str | int], msg: str,
            headers: dict[str, str] | None = None, outcome: str | None = None) -> HTTPException:
    """`outcome="unknown"`: the request may have taken effect (a 503 that is not "nothing was changed")."""
    detail: dict = {"error": error, "errors": [{"loc": loc, "msg": msg}]}
    if outcome is not None:
        detail["outcome"] = outcome
    return HTTPException(status, detail, headers=headers)


class KeyBeforeBody:
    """Check the API key of a POST, PUT or PATCH (every such route takes one; any other path answers 401 too)
    before anything reads its body: a request without a valid key is refused 401 at once, its body neither held
    nor parsed (up to the body limit each, 5 MiB, at no cost to a sender without a key). A filter only: the route
    checks the key again once the body is in (a key revoked while a slow body arrived is refused then). A key that
    cannot be checked now (Redis or the operator log unavailable, or a failure nobody expected) is left to the
    route, which answers it as it always has (503, saying whether an earlier attempt under an Idempotency-Key may
    have been published; 500 in the one error shape)."""

    def __init__(self, app, resolve: Callable[[str], Principal | None]):
        self.app, self.resolve = app, resolve

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        token = bearer_token(first_header(scope, b"authorization").decode("latin-1"))
        try:
            found = await run_in_threadpool(self.resolve, token) if token else None
        except Exception:  # noqa: BLE001 - answered by the route, in its words (see above)
            return await self.app(scope, receive, send)
        if found is None:
            return await key_refused(NO_VALID_KEY)(scope, receive, send)
        return await self.app(scope, receive, send)


def key_refused(refusal: tuple[int, str, str]) -> JSONResponse:
    """401 or 403 (`NO_VALID_KEY`, `NOT_A_TENANT_KEY`), as the API's routes answer them, answered ahead of them."""
    status, error, msg = refusal
    metrics.INGEST_REJECTED.labels(str(status)).inc()
    return JSONResponse({"error": error, "errors": [{"loc": ["header", "authorization"], "msg": msg}]},
                        status_code=status)


class BodyLimit:
    """Refuse bodies over `limit` bytes with 413, declared or chunked, before the app sees them: the
    body is read up to the limit here (never more), then handed on."""

    def __init__(self, app, limit: int, on_refused=lambda status: None):
        self.app = app
        self.limit = limit
        self.on_refused = on_refused  # counts what is answered here, before the app (and its counting) sees it

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            return await self.app(scope, receive, send)
        declared = first_header(scope, b"content-length")
        if declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(too_large(self.limit), scope, receive, send)
        chunks, seen, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.limit:
                return await self._refuse(too_large(self.limit), scope, receive, send)
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if b"json" in first_header(scope, b"content-type", b"json") and (why := _unholdable(body)):
            return await self._refuse(JSONResponse({"error": "invalid_request", "errors": [
                {"loc": ["body"], "msg": why}]}, status_code=400), scope, receive, send)
        delivered = False

        async def replay():
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)

    async def _refuse(self, answer: JSONResponse, scope, receive, send):
        self.on_refused(answer.status_code)
        return await answer(scope, receive, send)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _unholdable(body: bytes) -> str | None:
    """Why a JSON body no store or event can hold is refused, saying where (None: it can be held): bytes that are
    not UTF-8 (an encoded surrogate among them), or an unpaired surrogate escape ("\\ud800"), which Python's
    parser takes."""
    try:
        body.decode()
    except UnicodeDecodeError as exc:
        return f"the body is not UTF-8: byte 0x{body[exc.start]:02x} at offset {exc.start} ({exc.reason})"
    if _SURROGATE_ESCAPE.search(body):
        try:
            orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            return f"JSON decode error: {exc}"
    return None


def too_large(limit: int) -> JSONResponse:
    return JSONResponse({"error": "payload_too_large", "errors": [
        {"loc": ["body"], "msg": f"request bodies are limited to {limit} bytes"}]}, status_code=413)


def answer_options(app: FastAPI) -> None:
    """OPTIONS on any path answers 204 with every method its routes allow (not only the first route's)."""
    @app.middleware("http")
    async def _options(request: Request, call_next):
        if request.method != "OPTIONS":
            return await call_next(request)
        allowed = {method for method in ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")
                   if any(route.matches({**request.scope, "method": method})[0] == Match.FULL
                          for route in app.router.routes)}
        if not allowed:
            return JSONResponse({"error": "not_found", "errors": [{"loc": ["path"], "msg": "no such path"}]}, 404)
        return Response(status_code=204, headers={"Allow": ", ".join(sorted(allowed | {"OPTIONS"}))})


SEND_ROUTES = ("/v1/sends", "/v1/sends/batch")
RETRY_WITH_KEY = "retry after a moment with the same Idempotency-Key (sends then keep their send ids and are sent once)"


class EarlierAttemptMayBePublished(PublishOutcomeUnknown):
    """A request that published nothing itself, under an Idempotency-Key an earlier attempt may have published
    under (its outcome was unknown, or its process died while publishing): answered `"outcome": "unknown"`, never
    "nothing was published", which would let the client send it again under a new key."""

    @classmethod
    def after(cls, failure: PublishError | StoreUnavailable) -> "EarlierAttemptMayBePublished":
        return cls(earlier_attempt_may_be_published("the state store is unavailable" if isinstance(
            failure, StoreUnavailable) else "the message broker did not take it"))


def earlier_attempt_may_be_published(why_not_this_one: str) -> str:
    """What a keyed request that published nothing itself is told: its key's earlier attempt may have."""
    return (f"this attempt published nothing ({why_not_this_one}), but an earlier attempt under this "
            f"Idempotency-Key may have been published: {RETRY_WITH_KEY}")


def first_header(scope, name: bytes, default: bytes = b"") -> bytes:
    """A request's header as the API reads it (Starlette's `headers.get`): its first value. Anything checked ahead
    of the API must read the same one, or a second header of the name would be checked in its place."""
    return next((value for key, value in scope.get("headers") or [] if key == name), default)


def bearer_token(authorization: str) -> str:
    """The API key an `Authorization` header carries ("" when it names no bearer token): the scheme in any case
    (RFC 9110), white space around it and the token ignored."""
    scheme, _space, credentials = authorization.strip().partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" else ""


# How a request without a valid key, and one with another role's key on a tenant's route, are refused (status,
# error, message): by the API's routes, and by the bulk proxy before it forwards a batch.
NO_VALID_KEY = (401, "unauthorized", "a valid API key is required (Bearer)")
NOT_A_TENANT_KEY = (403, "forbidden", "this needs a tenant key")


def key_problem(refusal: tuple[int, str, str]) -> HTTPException:
    status, error, msg = refusal
    return problem(status, error, ["header", "authorization"], msg)


BEARER = HTTPBearer(auto_error=False, scheme_name="apiKey",
                    description="an API key (`streams keys create`): `Authorization: Bearer <key>`")


class Auth:
    """The FastAPI dependencies that turn `Authorization: Bearer <key>` into a principal. `guard`
    (checked at most every few seconds) rebuilds the API keys from the operator log when Redis has
    lost its data, so tenants keep publishing without an operator."""

    def __init__(self, keys: ApiKeys, guard: StateGuard | None):
        self.keys, self.guard = keys, guard
        self._log_unreadable_at = 0.0  # a failed check is raised to every request until one finishes: said once a while

    def principal(self, request: Request,
                  _: Annotated[HTTPAuthorizationCredentials | None, Security(BEARER)] = None) -> Principal:
        # BEARER documents the scheme in the OpenAPI; the header is read here, every failure a 401 in one shape.
        try:
            return self._principal(request)
        except StoreUnavailable as exc:
            if request.url.path in SEND_ROUTES and request.headers.get("idempotency-key"):
                # The key's record is in the store too: this attempt may retry one that was published, and "nothing
                # was changed" would let its client send it again under a new key.
                raise EarlierAttemptMayBePublished.after(exc) from exc
            raise

    def _principal(self, request: Request) -> Principal:
        found = self.resolve(bearer_token(request.headers.get("authorization", "")))
        if found is None:
            raise key_problem(NO_VALID_KEY)
        return found

    def resolve(self, token: str) -> Principal | None:
        """The principal of an API key (None: no valid one), after the state guard's look (see the class doc).
        StoreUnavailable: Redis cannot say."""
        if self.guard is not None:
            try:
                self.guard.check()
            except StackError as exc:  # the operator log is unreadable: keys in Redis still work
                if (now := time.monotonic()) >= self._log_unreadable_at:
                    self._log_unreadable_at = now + UNREADABLE_LOG_EVERY_S
                    log.warning("cannot check Redis state against the operator log: %s", exc)
        return self.keys.resolve(token) if token else None

    # The role checks are async: no I/O, so no hop to a worker thread (only `principal` reads Redis).
    def tenant_dependency(self) -> Callable[..., Any]:
        async def tenant(p: Annotated[Principal, Depends(self.principal)]) -> str:
            if p.role != "tenant" or not p.tenant:
                raise key_problem(NOT_A_TENANT_KEY)
            return p.tenant

        return tenant

    def operator_dependency(self) -> Callable[..., Any]:
        async def operator(p: Annotated[Principal, Depends(self.principal)]) -> Principal:
            if p.role != "operator":
                raise problem(403, "forbidden", ["header", "authorization"], "this needs an operator key")
            return p

        return operator
