"""HTTP ingest API (`streams api`): tenants publish sends and read their status; operators manage
limits, quotas, keys, dead letters and endpoints (`operator_api.py`).

Authentication is by API key (`Authorization: Bearer <key>`); the tenant always comes from the key,
never from the request body, and a tenant key cannot reach `/v1/admin/*`. Errors have one shape
(`web.ErrorBody`).

Publishing a request is all or nothing: its sends are checked (schema, policy, size, the tenant's
quotas), then published in one producer transaction (one send: one acknowledged record), and only
then recorded as `accepted`. Handlers are async and wait for the broker without holding a thread;
at most MAX_IN_FLIGHT requests publish at once, and one tenant at most TENANT_BATCHES multi-record
requests at once. With `bulk_socket`, batches are served by the bulk process (bulk.py) at a lower CPU
priority, so a tenant posting large batches at full speed does not slow another's single sends.
"""


import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import orjson
from confluent_kafka import KafkaException
from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import metrics
from ..errors import (
    BrokerUnavailable,
    LimitOutOfRange,
    PublishError,
    PublishOutcomeUnknown,
    SendTooLarge,
    StoreUnavailable,
    StoreWriteUnknown,
)
from ..gate.limits import LimitStore
from ..lanes import lane_for
from ..providers.registry import Registry, load_registry
from ..send import (
    INTEGERS,
    MAX_BATCH,
    MAX_SEND_BYTES,
    SEND_VARIANTS,
    WHITE_SPACE,
    Send,
    SendRequest,
    build_send,
    flatten_errors,
    new_send_id,
    policy_error,
    uncarried_errors,
)
from ..state.audit import AuditLog
from ..state.guard import StateGuard
from ..webhooks.api import webhook_routes
from ..webhooks.fanout import fan_out
from ..webhooks.ingest import WebhookIngest
from ..webhooks.skipped import outcome_records, skipped_records
from .api_keys import ApiKeys
from .bulk import BulkProxy
from .docs import mount_docs
from .idempotency import (
    MAX_KEY_LENGTH,
    Answered,
    Claimed,
    Conflict,
    IngestIdempotency,
    OtherRoute,
    body_hash,
    sends_digest,
)
from .publisher import Record, RecordTooLarge
from .quotas import BeyondBurst, IngestQuotas, OverQuota
from .sdk import SendClient, keyed_send_id
from .sender_store import SenderDomainStore
from .senders import SenderDomains, sender_of
from .status import StatusStore
from .web import (
    RETRY_WITH_KEY,
    Auth,
    BodyLimit,
    EarlierAttemptMayBePublished,
    KeyBeforeBody,
    answer_options,
    documented,
    finish_openapi,
    internal_error,
    problem,
)

log = logging.getLogger("streams.api")
UNAVAILABLE_LOG_EVERY_S = 10

MAX_BODY_BYTES = 5 * 1024 * 1024  # 5 MiB per request
# A request's webhook payloads as fanned out (each event copied to every endpoint subscribed to it): 50 endpoints
# made a 5 MiB batch 250 MiB of records in the process, held while it waited its turn to publish.
MAX_FANNED_OUT_BYTES = 16 * 1024 * 1024
MAX_IN_FLIGHT = 256               # requests publishing at once (the rest wait their turn)
TENANT_BATCHES = 1                # multi-record requests of one tenant publishing at once
# What a tenant sees of a send (statuses: accepted, retrying, unknown, delivered, dead_lettered).
SEND_STATUS_FIELDS = ("tenant_id", "status", "channel", "lane", "attempts", "accepted_at_ms", "completed_at_ms",
                      "provider", "provider_message_id", "reason", "replay_of", "providers_tried", "attempt_history")


class BatchRequest(BaseModel):
    sends: list[SendRequest] = Field(min_length=1, max_length=MAX_BATCH)


class Delivery(BaseModel):
    delivery_id: str
    endpoint_id: str
    skipped: str | None = Field(None, description="why it was recorded as skipped instead of enqueued "
                                                  "(endpoint_degraded, endpoint_disabled: disabled by a 410 Gone, "
                                                  "backlog_shed)")


class Accepted(BaseModel):
    send_id: str = Field(description="the send's id (for a webhook event: the event's id)")
    lane: str
    deliveries: list[Delivery] | None = Field(None, description="webhook events: one delivery per subscribed endpoint")
    note: str | None = None


class BatchAccepted(BaseModel):
    accepted: int
    sends: list[Accepted]


class SendStatus(BaseModel):
    send_id: str
    tenant_id: str
    status: str
    model_config = {"extra": "allow"}


@dataclass
class Ingest:
    """Everything the API works with."""

    client: SendClient
    store: StatusStore
    keys: ApiKeys
    limits: LimitStore
    known_policies: frozenset[str]
    quotas: IngestQuotas | None = None
    idempotency: IngestIdempotency | None = None
    audit: AuditLog | None = None
    guard: StateGuard | None = None
    webhooks: WebhookIngest | None = None
    senders: SenderDomains | SenderDomainStore = field(default_factory=SenderDomains)  # fixed, or the operator's
    # The providers operators may set limits for and end cool-downs of (the ingest quotas are known besides).
    registry: Registry = field(default_factory=load_registry)


IdempotencyKey = Annotated[str | None, Header(
    alias="Idempotency-Key", max_length=MAX_KEY_LENGTH,
    # Documented only (the handler refuses a blank key with its own message): not only white space.
    json_schema_extra={"pattern": f"[^{WHITE_SPACE}]"},
    description="the same key and body within 24 h: the first answer again, nothing published twice; another "
                "body, or the other of /v1/sends and /v1/sends/batch, under a key used in the last 24 h: 422 "
                "(idempotency_key_reused)")]
HTTP_ERRORS = {404: "not_found", 405: "method_not_allowed"}
JSON_VALUE = "#/components/schemas/JsonValue"
PAYLOAD_OBJECTS = ("EmailPayload", "SmsPayload", "WebhookPayload", "Tag")


def carried_values(schema: dict[str, Any]) -> None:
    """Say in the OpenAPI what a payload's open parts (extra fields, a webhook's `data`) may hold."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["JsonValue"] = {
        "description": f"any JSON value, but integers only from {INTEGERS[0]} to {INTEGERS[1]} and strings without "
                       "unpaired surrogates (what the events carry)",
        "anyOf": [{"type": ["null", "boolean", "string"]}, {"type": "number", "not": {"type": "integer"}},
                  {"type": "integer", "minimum": INTEGERS[0], "maximum": INTEGERS[1]},
                  {"type": "array", "items": {"$ref": JSON_VALUE}},
                  {"type": "object", "additionalProperties": {"$ref": JSON_VALUE}}]}
    for name in PAYLOAD_OBJECTS:
        if name in components:
            components[name]["additionalProperties"] = {"$ref": JSON_VALUE}
    data = components.get("WebhookPayload", {}).get("properties", {}).get("data")
    if data is not None:
        data["additionalProperties"] = {"$ref": JSON_VALUE}


def name_policies(schema: dict[str, Any], known_policies: frozenset[str]) -> None:
    """`policy`, in the OpenAPI, is one of the names the policy file defines (the API refuses others)."""
    components = schema.get("components", {}).get("schemas", {})
    for variant in SEND_VARIANTS.values():
        policy = components.get(variant.__name__, {}).get("properties", {}).get("policy")
        if policy is not None:
            named = [{"type": "string", "enum": sorted(known_policies)}] if known_policies else []
            policy["anyOf"] = [*named, {"type": "null"}]


async def keep_lease(idempotency: IngestIdempotency, tenant_id: str, key: str, holder: str) -> None:
    """Renew a claimed Idempotency-Key's lease every third of it until cancelled (the request is
    answered). A Redis error is logged and tried again at the next turn; a lease no longer ours
    (it lapsed and another request took the key) is not taken back."""
    while True:
        await asyncio.sleep(idempotency.lease_s / 3)  # the renewal's period, not synchronisation
        try:
            if not await run_in_threadpool(idempotency.renew, tenant_id, key, holder):
                log.warning("an Idempotency-Key's lease lapsed while its request was being published")
                return
        except Exception as exc:  # noqa: BLE001 - Redis down or anything else: renewing goes on
            log.warning("an Idempotency-Key's lease was not renewed: %s", exc)


def published_nothing(exc: BaseException) -> bool:
    """A request that failed this way is known to have published nothing (refused before publishing,
    or a publish the broker reported failed or aborted whole). Anything else (an outcome the broker left
    unknown, a request cancelled or failed unexpectedly while publishing) may have been published."""
    if isinstance(exc, PublishOutcomeUnknown):
        return False
    return isinstance(exc, (StarletteHTTPException, RequestValidationError, StoreUnavailable, PublishError))


def create_app(ingest: Ingest, max_body: int = MAX_BODY_BYTES, bulk_socket: str | None = None) -> FastAPI:
    """The API; with `bulk_socket`, batches are forwarded to the bulk process listening there (bulk.py)."""
    app = FastAPI(title="dual-rail dispatch ingest API", version="1", docs_url=None, redoc_url=None,
                  description="Publish notification sends and read their status. Batches hold at most "
                              f"{MAX_BATCH} sends and are accepted or rejected whole; a send may be at most "
                              f"{MAX_SEND_BYTES} bytes, a request body at most {max_body} bytes.")
    mount_docs(app)  # the docs' scripts come from the package, not a CDN: they work air-gapped
    auth = Auth(ingest.keys, ingest.guard)
    Tenant = Annotated[str, Depends(auth.tenant_dependency())]  # noqa: N806 - a type alias
    client, store, webhooks = ingest.client, ingest.store, ingest.webhooks
    in_flight = asyncio.Semaphore(MAX_IN_FLIGHT)
    ending_claims: set[asyncio.Future] = set()  # Idempotency-Key claims being freed or lapsed (kept referenced)
    tenant_batches: dict[str, asyncio.Semaphore] = {}

    async def unauthenticated(request: Request) -> JSONResponse | None:
        """The answer for a caller without a valid key, checked here for a body the framework could not parse:
        it parses the body before any dependency runs, so a caller without a key would learn about its JSON
        (and cost a parse) before being told it needs one. Every other request is authenticated first."""
        try:
            await run_in_threadpool(auth.principal, request)
        except StarletteHTTPException as denied:
            return await _http(request, denied)
        except StoreUnavailable as exc:
            return await _store(request, exc)
        except PublishError as exc:  # a keyed send whose key could not be checked (`Auth.principal`)
            return await _broker(request, exc)
        return None

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"loc": list(e["loc"]), "msg": e["msg"]} for e in flatten_errors(exc.errors())]
        status = 400 if any(e["msg"].startswith("JSON decode error") for e in errors) else 422
        content_type = request.headers.get("content-type", "")
        kind, _, subtype = content_type.split(";")[0].strip().lower().partition("/")
        read_as_json = kind == "application" and (subtype == "json" or subtype.endswith("+json"))  # as FastAPI
        if content_type and any(e["loc"][:1] == ["body"] for e in errors) and not read_as_json:
            # The body was never read as JSON: its errors say nothing of it; the others stand.
            errors = [{"loc": ["header", "content-type"],
                       "msg": f"the body is read as JSON only when sent with Content-Type: application/json (got "
                              f"{content_type[:60]!r})"}] + [e for e in errors if e["loc"][:1] != ["body"]]
        if status == 400 and (denied := await unauthenticated(request)) is not None:
            return denied
        metrics.INGEST_REJECTED.labels(str(status)).inc()
        return JSONResponse({"error": "invalid_request", "errors": errors}, status_code=status)

    @app.exception_handler(StarletteHTTPException)  # ours, and the router's own (no such path, method not allowed)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and not isinstance(exc.detail, dict):  # the framework could not parse the body
            if (denied := await unauthenticated(request)) is not None:
                return denied
            body: object = {"error": "invalid_request", "errors": [{"loc": ["body"], "msg": (
                "the request body could not be read as JSON (nested too deeply for the parser?)")}]}
        else:
            body = exc.detail if isinstance(exc.detail, dict) else {
                "error": HTTP_ERRORS.get(exc.status_code, "http_error"),
                "errors": [{"loc": [], "msg": str(exc.detail)}]}
        metrics.INGEST_REJECTED.labels(str(exc.status_code)).inc()
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)  # a bug: answered in the error shape, then logged with its traceback
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        metrics.INGEST_REJECTED.labels("500").inc()
        return internal_error(request, exc)

    # A 503 says which kind of dependency failed, never its error text: that names internal hosts and
    # ports, and it is answered before the caller's key could be checked (the keys live in Redis).
    @app.exception_handler(StoreUnavailable)
    async def _store(request: Request, exc: StoreUnavailable) -> JSONResponse:
        if isinstance(exc, StoreWriteUnknown):  # a change Redis did not answer, which the workers may be using
            return _unavailable(request, exc, "the state store", "the state store did not answer this change: it "
                                "may have been made (a rotated secret or key may be in use, unseen); read it back "
                                "before deciding, or make the change again to get one you hold", outcome="unknown")
        # Nothing was published or changed: the client may retry after a moment.
        return _unavailable(request, exc, "the state store", "the state store is unavailable; retry after a moment")

    @app.exception_handler(LimitOutOfRange)  # an ingest quota edited by hand to 0 or below: refused, not lifted
    async def _misconfigured(request: Request, exc: LimitOutOfRange) -> JSONResponse:
        return _unavailable(request, exc, "the ingest quotas", "an ingest quota of this tenant is misconfigured; "
                            "nothing was published: retry once an operator has set it again")

    @app.exception_handler(PublishError)
    @app.exception_handler(BrokerUnavailable)
    @app.exception_handler(KafkaException)
    async def _broker(request: Request, exc: Exception) -> JSONResponse:
        # The broker did not acknowledge (an audit record, a replay, a reactivation: not applied, or with
        # PublishOutcomeUnknown maybe applied), or did not answer a read (dead letters, the audit trail).
        if isinstance(exc, EarlierAttemptMayBePublished):
            dependency = "the state store" if isinstance(exc.__cause__, StoreUnavailable) else "the broker"
            return _unavailable(request, exc, dependency, str(exc), outcome="unknown")
        if isinstance(exc, PublishOutcomeUnknown):
            if request.url.path not in ("/v1/sends", "/v1/sends/batch"):  # a change, not a send: no key here
                retry = "look at its result before making it again"
            elif request.headers.get("idempotency-key"):
                retry = RETRY_WITH_KEY
            else:
                retry = "a retry without an Idempotency-Key is published under new send ids (send one to retry safely)"
            return _unavailable(request, exc, "the broker", "the message broker did not confirm the publish: it may "
                                f"have taken effect; {retry}", outcome="unknown")
        return _unavailable(request, exc, "the broker", "the message broker did not answer; retry after a moment"
                            + (" (with the same Idempotency-Key)" if request.url.path.startswith("/v1/sends") else ""))

    logged_at: dict[str, float] = {}

    def _unavailable(request: Request, exc: Exception, dependency: str, msg: str,
                     outcome: str | None = None) -> JSONResponse:
        now = time.monotonic()
        if now - logged_at.get(dependency, -UNAVAILABLE_LOG_EVERY_S) >= UNAVAILABLE_LOG_EVERY_S:
            logged_at[dependency] = now  # an outage at full request rate must not flood the log
            log.warning("503 on %s %s (%s; logged at most every %d s, all counted in "
                        "dispatch_ingest_rejected_total): %s", request.method, request.url.path, dependency,
                        UNAVAILABLE_LOG_EVERY_S, exc)
        metrics.INGEST_REJECTED.labels("503").inc()
        body: dict[str, Any] = {"error": "unavailable", "errors": [{"loc": [], "msg": msg}]}
        if outcome is not None:
            body["outcome"] = outcome  # "unknown": the request may have taken effect (a retry with its key is safe)
        return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = finish_openapi(FastAPI.openapi(app))
            name_policies(schema, ingest.known_policies)
            carried_values(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    def expand(tenant_id: str, req: SendRequest, id_for: Callable[[str], str] | None
               ) -> tuple[Accepted, list[Send], list[tuple[Send, str]]]:
        """A send, or a webhook event fanned out to its subscribed endpoints: the deliveries to
        enqueue and those recorded as skipped (endpoint degraded or disabled by a 410, backlog shed). Reads Redis."""
        if req.channel != "webhook":
            send = build_send(req, tenant_id, routing=client.routing, send_id=id_for("send") if id_for else None)
            return Accepted(send_id=send.send_id, lane=send.lane, deliveries=None), [send], []
        event_type = req.payload["event_type"]
        enqueue: list[Send] = []
        skipped: list[tuple[Send, str]] = []
        subscribed = []
        if webhooks is None:
            event_id = id_for("event") if id_for else new_send_id()
        else:
            subscribed = webhooks.endpoints.subscribers(tenant_id, event_type)
            event_id, deliveries = fan_out(req, tenant_id, subscribed, client.routing, id_for=id_for)
            enqueue, skipped = webhooks.admit(deliveries, frozenset(e.id for e in subscribed if e.state == "disabled"))
        note = None if subscribed else (f"accepted with no delivery: no enabled endpoint of this tenant subscribes "
                                        f"to {event_type!r}")
        reasons = {d.send_id: reason for d, reason in skipped}
        return Accepted(send_id=event_id, lane=lane_for(req.category), note=note,
                        deliveries=[Delivery(delivery_id=d.send_id, endpoint_id=d.payload["endpoint_id"],
                                             skipped=reasons.get(d.send_id))
                                    for d in [*enqueue, *(s for s, _ in skipped)]]), enqueue, skipped

    def fanned_out(requests: list[SendRequest], expanded: list, where: Callable[[int], list[str | int]]) -> None:
        """413 for a request whose webhook events, copied to each endpoint subscribed, pass MAX_FANNED_OUT_BYTES of
        payload (before a record is encoded: the bound is on what the process would hold)."""
        total = 0
        for i, (r, (_, enqueue, skipped)) in enumerate(zip(requests, expanded, strict=True)):
            if r.channel == "webhook" and (copies := len(enqueue) + len(skipped)):
                total += len(orjson.dumps(r.payload)) * copies
                if total > MAX_FANNED_OUT_BYTES:
                    raise problem(413, "fan_out_too_large", where(i), f"the request's webhook events, copied to "
                                  f"each endpoint subscribed, come to more than {MAX_FANNED_OUT_BYTES} bytes of "
                                  f"payload by this one ({copies} endpoints): send fewer or smaller events a request "
                                  f"(an event to {copies} endpoints carries at most {MAX_FANNED_OUT_BYTES // copies} "
                                  "bytes of payload)")

    def prepare(tenant_id: str, requests: list[SendRequest], batch: bool, key: str | None, claim: Claimed
                ) -> tuple[list[Accepted], list[Send], list[tuple[Send, str]], list[int], bool, list[Record]]:
        """Everything checked before a byte is produced: policies, fan-out, sizes, quotas. Also returns, for
        each of the sends and then each of the skipped deliveries, the index of the request it came from (a
        webhook event fans out to several: an error names the request, not the expanded position), whether
        the quotas were charged (not when an earlier attempt under the key was, for the same sends), and the
        records to publish (the sends', then the skipped deliveries')."""
        first_ms = claim.first_ms
        def where(index: int) -> list[str | int]:
            return ["body", "sends", index] if batch else ["body"]

        errors = [e for i, r in enumerate(requests)
                  if (e := policy_error(r, ingest.known_policies, ("body", "sends", i) if batch else ("body",)))]
        senders = (ingest.senders.rules_for(tenant_id) if any(r.channel == "email" for r in requests)
                   else SenderDomains())
        if senders.enforced:
            for i, r in enumerate(requests):
                if r.channel != "email":
                    continue
                if why := senders.refusal(tenant_id, sender_of(r.payload)):
                    errors.append({"loc": [*where(i), "payload", "from"], "msg": why})
        if errors:
            raise HTTPException(422, {"error": "invalid_request", "errors": errors})

        def ids(position: int) -> Callable[[str], str] | None:
            if key is None:
                return None
            return lambda label: keyed_send_id(tenant_id, key, f"{position}:{label}", first_ms)  # type: ignore[arg-type]

        if webhooks is not None and any(r.channel == "webhook" for r in requests):
            webhooks.sync_view()
        expanded = [expand(tenant_id, r, ids(i)) for i, r in enumerate(requests)]
        sends = [s for _, group, _ in expanded for s in group]
        skipped = [s for _, _, group in expanded for s in group]
        origins = ([i for i, (_, group, _) in enumerate(expanded) for _ in group]
                   + [i for i, (_, _, group) in enumerate(expanded) for _ in group])
        try:
            fanned_out(requests, expanded, where)
            # The skipped deliveries too: kept on their topic, each is replayed later as a send of its own. Encoded
            # here, off the event loop (a webhook event copied to 50 endpoints can be megabytes), once.
            checked = client.records(sends + [s for s, _ in skipped])
        except SendTooLarge as exc:
            i = origins[exc.index]
            raise problem(413, "send_too_large", where(i), f"{'send ' + str(i) if batch else 'the send'} is "
                          f"{exc.size} bytes; a send may be at most {exc.limit} bytes") from None
        except orjson.JSONEncodeError as exc:
            errors = uncarried_errors([r.payload for r in requests], lambda i: [*where(i), "payload"])
            raise HTTPException(422, {"error": "invalid_request",
                                      "errors": errors or [{"loc": ["body"], "msg": str(exc)}]}) from None
        digest = sends_digest([s.send_id for s in sends]) if claim.holder else ""
        charged = False  # spared when an earlier attempt under the key was charged for these very sends
        if ingest.quotas is not None and (not digest or digest != claim.charged_before):
            verdict = ingest.quotas.admit(tenant_id, sends)
            if isinstance(verdict, OverQuota):
                raise problem(429, "quota_exceeded", ["header", "authorization"],
                              str(verdict), headers={"Retry-After": verdict.retry_after})
            if isinstance(verdict, BeyondBurst):
                raise problem(422, "quota_burst_exceeded", ["body", "sends"] if batch else ["body"],
                              f"{verdict.cost} sends at once can never fit the {verdict.quota} quota's burst: "
                              "send smaller batches")
            charged = True
            if digest and key is not None and ingest.idempotency is not None:
                try:
                    ingest.idempotency.charged(tenant_id, key, claim.holder, digest)
                except StoreUnavailable as exc:  # then a retry after an unknown outcome is charged again
                    log.warning("an Idempotency-Key's charge was not noted: %s", exc)
        records = checked[:len(sends)] + skipped_records(client.names, skipped)
        return [a for a, _, _ in expanded], sends, skipped, origins, charged, records

    async def publish(tenant_id: str, requests: list[SendRequest], batch: bool, key: str | None,
                      claim: Claimed) -> list[Accepted]:
        def where(index: int) -> list[str | int]:
            return ["body", "sends", index] if batch else ["body"]

        accepted, sends, skipped, origins, charged, records = await run_in_threadpool(prepare, tenant_id, requests,
                                                                                      batch, key, claim)
        deliveries = [s for s in sends if s.channel == "webhook"]
        if webhooks is not None and deliveries:
            await run_in_threadpool(webhooks.enqueued, deliveries)  # before they can be delivered: see `enqueued`
        fair = tenant_batches.setdefault(tenant_id, asyncio.Semaphore(TENANT_BATCHES)) if len(records) > 1 else None
        try:
            # A tenant's batches queue for their turn before taking one of the process's in-flight
            # places, so one tenant's many batches cannot hold every place while waiting.
            async with fair if fair is not None else contextlib.nullcontext():
                async with in_flight:
                    metrics.INGEST_IN_FLIGHT.inc()
                    try:
                        written = await client.publisher.publish_async(records)
                    finally:
                        metrics.INGEST_IN_FLIGHT.dec()
        except BaseException as exc:
            if charged and published_nothing(exc):
                # Refused whole: the request is charged nothing (its retry would be charged again).
                await run_in_threadpool(give_back, tenant_id, key, claim, sends)
            if webhooks is not None and deliveries and published_nothing(exc):
                await run_in_threadpool(webhooks.withdrawn, deliveries)
            if isinstance(exc, RecordTooLarge):
                i = origins[exc.index]
                raise problem(413, "send_too_large", where(i), f"{'send ' + str(i) if batch else 'the send'} is "
                              f"{exc.size} bytes as published; {exc.topic} accepts at most {exc.limit}") from None
            raise
        # Any other PublishError: answered 503 by `_broker`, without the broker's error text.
        await run_in_threadpool(after_publish, sends, skipped, written[len(sends):])
        metrics.INGEST_ACCEPTED_REQUESTS.inc()
        for s in sends:
            metrics.INGESTED.labels(s.channel, s.lane).inc()
        for _, reason in skipped:
            metrics.SKIPPED_DELIVERIES.labels(reason, "ingest").inc()
        return accepted

    def give_back(tenant_id: str, key: str | None, claim: Claimed, sends: list[Send]) -> None:
        """What the quotas took for a request published not at all. Its key's note of the charge goes first (back
        to the earlier attempt's): a key that stays pending (its release failing too) must not spare its retry a
        charge given back. Kept when the note cannot be put back, or the key is no longer this request's (its
        lease lapsed, and a retry that took it over may have been spared the charge on the strength of it)."""
        if key is not None and claim.holder and ingest.idempotency is not None:
            try:
                restored = ingest.idempotency.charged(tenant_id, key, claim.holder, claim.charged_before)
            except StoreUnavailable as exc:
                log.warning("a refused request's charge was kept: its Idempotency-Key's note of it was not "
                            "cleared (%s)", exc)
                return
            if not restored:
                log.warning("a refused request's charge was kept: its Idempotency-Key was taken over meanwhile")
                return
        assert ingest.quotas is not None
        ingest.quotas.give_back_request(tenant_id, sends)

    def after_publish(sends: list[Send], skipped: list[tuple[Send, str]], skipped_written) -> None:
        """Published: now recorded. A Redis or broker failure here does not undo the publish; the
        statuses come from the outcomes as the sends are dispatched. A skipped delivery is never
        dispatched, so its outcome goes to notif.outcomes first, whether or not Redis answers: the
        outcome recorder records its status (and lists it under its endpoint) from there."""
        outcomes = outcome_records(client.names, skipped, skipped_written, int(time.time() * 1000)) if skipped else []
        unpublished = []  # skipped deliveries' outcomes the broker did not take: the state store's to record
        if outcomes:
            try:
                client.publisher.publish([r for _, r in outcomes])
            except PublishError as exc:
                unpublished = [r for _, r in outcomes]
                log.warning("%d skipped deliveries' outcomes were not published (%s); their statuses are "
                            "recorded in the state store only", len(outcomes), exc)
        try:
            store.accepted(sends + [s for s, _ in skipped])
            for event, _ in outcomes:
                store.record_outcome(event)
        except StoreUnavailable as exc:
            # Their `accepted` status goes through notif.outcomes instead, as the SDK's does (not waited for): the
            # outcome recorder writes it, and `streams state recover` finds it. Without it a send answered 202
            # would read as unknown until its first outcome, hours away for a marketing send that waits.
            # A skipped delivery's outcome, not published above, is tried again the same way: else nothing would
            # record the delivery the 202 named (it is never dispatched).
            client.publisher.publish_unwaited(client.accepted_records(sends) + unpublished)
            log.warning("published %d sends, but recording them failed (%s); their statuses go through "
                        "notif.outcomes to the outcome recorder", len(sends) + len(skipped), exc)

    async def canonical(request: Request) -> object:
        """The body as the events read JSON (what an Idempotency-Key's body is compared on)."""
        try:
            return orjson.loads(await request.body())
        except orjson.JSONDecodeError as exc:  # valid for Python's parser, not for the events' (a lone surrogate)
            raise problem(400, "invalid_request", ["body"], f"JSON decode error: {exc}") from None

    async def idempotent(tenant_id: str, key: str | None, route: str, canonical: object, status: int,
                         run: Callable[[Claimed], object]) -> JSONResponse:
        """Run `run(claim)` once per (tenant, key, route, body) within 24 h; replay its answer after that."""
        if key is None or ingest.idempotency is None:
            return JSONResponse(await run(Claimed(int(time.time() * 1000), "")), status)  # type: ignore[misc]
        if not key.strip():
            raise problem(422, "invalid_request", ["header", "Idempotency-Key"], "an Idempotency-Key cannot be empty")
        try:
            digest = body_hash(canonical)
        except orjson.JSONEncodeError:  # a field the sends ignore, nested past what a canonical form can hold
            raise problem(422, "invalid_request", ["body"], "the request body is nested more than 254 levels deep: "
                          "it has no canonical form for its Idempotency-Key") from None
        try:
            state = await run_in_threadpool(ingest.idempotency.begin, tenant_id, key, digest, route)
        except StoreUnavailable as exc:  # this attempt published nothing; whether an earlier one under the key did
            raise EarlierAttemptMayBePublished.after(exc) from exc  # cannot be told without the store
        if isinstance(state, Answered):
            return JSONResponse(state.body, state.status, headers={"Idempotent-Replayed": "true"})
        if isinstance(state, Conflict):
            raise problem(422, "idempotency_key_reused", ["header", "Idempotency-Key"],
                          "this Idempotency-Key was used with a different request body in the last 24 h")
        if isinstance(state, OtherRoute):
            raise problem(422, "idempotency_key_reused", ["header", "Idempotency-Key"],
                          f"this Idempotency-Key was used on {state.route} in the last 24 h")
        if not isinstance(state, Claimed):
            raise problem(409, "request_in_progress", ["header", "Idempotency-Key"],
                          "a request with this Idempotency-Key is still being published", {"Retry-After": "1"})
        lease = asyncio.create_task(keep_lease(ingest.idempotency, tenant_id, key, state.holder))
        try:
            body = await run(state)  # type: ignore[misc]
        except BaseException as exc:
            lease.cancel()
            # Nothing published: the key is free for any request. Maybe published: the retry under the
            # key must publish the same send ids.
            freeing, keys = published_nothing(exc), ingest.idempotency

            async def end_claim() -> None:
                try:
                    await run_in_threadpool(keys.release if freeing else keys.lapse, tenant_id, key, state.holder)
                except Exception as store_exc:  # noqa: BLE001 - the request's own failure is the answer
                    # The key stays pending until its lease lapses (60 s); the retry then keeps its send ids.
                    log.warning("an Idempotency-Key was not %s: %s", "freed" if freeing else "lapsed", store_exc)

            ending = asyncio.ensure_future(end_claim())  # finishes even if this request is cancelled meanwhile
            ending_claims.add(ending)
            ending.add_done_callback(ending_claims.discard)
            await asyncio.shield(ending)
            if freeing and state.maybe_published_before and isinstance(exc, (PublishError, StoreUnavailable)):
                raise EarlierAttemptMayBePublished.after(exc) from exc
            if state.maybe_published_before and isinstance(exc, StarletteHTTPException) and isinstance(exc.detail,
                                                                                                      dict):
                # Refused now (a quota, a policy or a sender domain changed since), and still never "not
                # published": the refusal says so, or the client would drop a request that may be delivered.
                exc.detail = {**exc.detail, "outcome": "unknown", "errors": [*exc.detail.get("errors", []), {
                    "loc": ["header", "Idempotency-Key"], "msg": "this attempt published nothing, but an earlier "
                    "attempt under this Idempotency-Key may have been published: its sends may be delivered"}]}
            raise
        lease.cancel()
        try:
            if not await run_in_threadpool(ingest.idempotency.finish, tenant_id, key, status, body, state.holder):
                log.warning("an idempotent answer was not stored: the key's lease had lapsed and another "
                            "request took it over")
        except StoreUnavailable as exc:  # published: answer it; a retry publishes the same ids again
            log.warning("an idempotent answer was not stored: %s", exc)
        return JSONResponse(body, status)

    @app.post("/v1/sends", status_code=202, response_model=Accepted, response_model_exclude_none=True,
              responses=documented(400, 401, 403, 409, 413, 422, 429, 503))
    async def post_send(body: SendRequest, tenant_id: Tenant, request: Request,
                        key: IdempotencyKey = None) -> JSONResponse:
        async def run(claim: Claimed) -> dict:
            [accepted] = await publish(tenant_id, [body], False, key, claim)
            return accepted.model_dump(exclude_none=True)

        return await idempotent(tenant_id, key, "POST /v1/sends", await canonical(request), 202, run)

    @app.post("/v1/sends/batch", status_code=202, response_model=BatchAccepted,
              responses=documented(400, 401, 403, 409, 413, 422, 429, 503))
    async def post_batch(body: BatchRequest, tenant_id: Tenant, request: Request,
                         key: IdempotencyKey = None) -> JSONResponse:
        async def run(claim: Claimed) -> dict:
            accepted = await publish(tenant_id, body.sends, True, key, claim)
            return {"accepted": len(accepted), "sends": [a.model_dump(exclude_none=True) for a in accepted]}

        return await idempotent(tenant_id, key, "POST /v1/sends/batch", await canonical(request), 202, run)

    if webhooks is not None:
        app.include_router(webhook_routes(webhooks, store, client, auth.tenant_dependency(), ingest.quotas))

    @app.get("/v1/sends/{send_id}", response_model=SendStatus, responses=documented(401, 403, 404, 503))
    def get_send(send_id: str, tenant_id: Tenant) -> dict:
        doc = store.get(send_id)
        # Another tenant's send is indistinguishable from a missing one.
        if doc is None or doc.get("tenant_id") != tenant_id:
            store.require_data()  # missing because Redis lost its data, not yet recovered: 503, not "no such send"
            raise problem(404, "not_found", ["path", "send_id"], "no such send for this tenant")
        return {"send_id": send_id, **{k: v for k, v in doc.items() if k in SEND_STATUS_FIELDS}}

    from .operator_api import operator_routes

    app.include_router(operator_routes(ingest, auth.operator_dependency()))

    from prometheus_client import make_asgi_app

    app.mount("/metrics", make_asgi_app())
    answer_options(app)
    return KeyBeforeBody(BodyLimit(BulkProxy(app, bulk_socket, auth.resolve), max_body,  # type: ignore[return-value]
                                   on_refused=lambda status: metrics.INGEST_REJECTED.labels(str(status)).inc()),
                         auth.resolve)
