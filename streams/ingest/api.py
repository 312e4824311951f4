"""HTTP ingest API (`streams api`): tenants publish sends and read their status; operators set limits.

Authentication is by API key (`Authorization: Bearer <key>`); keys are stored hashed in Redis and
carry a role. The tenant always comes from the key, never from the request body. A tenant key
cannot reach `/v1/admin/*`. Errors are JSON: `{"error": ..., "errors": [{"loc": [...], "msg": ...}]}`.
"""

import logging
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from .. import metrics
from ..errors import ConfigError, PublishError, StackError, StoreUnavailable
from ..gate.limits import LimitChange, LimitStore
from ..lanes import lane_for
from ..send import MAX_BATCH, Send, SendRequest, build_send, flatten_errors, new_send_id, policy_error
from ..state.guard import StateGuard
from ..webhooks.api import webhook_routes
from ..webhooks.fanout import fan_out
from ..webhooks.ingest import WebhookIngest
from .api_keys import ApiKeys, Principal
from .sdk import SendClient
from .status import StatusStore

log = logging.getLogger("streams.api")

MAX_BODY_BYTES = 5 * 1024 * 1024  # 5 MiB per request
# What a tenant sees of a send (statuses: accepted, retrying, unknown, delivered, dead_lettered).
SEND_STATUS_FIELDS = ("tenant_id", "status", "channel", "lane", "attempts", "accepted_at_ms", "completed_at_ms",
                      "provider", "provider_message_id", "reason", "replay_of", "attempt_history")


class BatchRequest(BaseModel):
    sends: list[SendRequest] = Field(min_length=1, max_length=MAX_BATCH)


class Delivery(BaseModel):
    delivery_id: str
    endpoint_id: str
    skipped: str | None = Field(None, description="why it was recorded as skipped instead of enqueued "
                                                  "(endpoint_degraded, backlog_shed)")


class Accepted(BaseModel):
    send_id: str = Field(description="the send's id (for a webhook event: the event's id)")
    lane: str
    deliveries: list[Delivery] | None = Field(None, description="webhook events: one delivery per subscribed endpoint")
    note: str | None = None


class LimitUpdate(BaseModel):
    global_rate: int | None = Field(None, ge=1)
    global_burst: int | None = Field(None, ge=1)
    reserve: int | None = Field(None, ge=0)
    tenant: str | None = Field(None, description="a tenant id, or '*' for the default")
    tenant_rate: int | None = Field(None, ge=1)
    tenant_burst: int | None = Field(None, ge=1)
    concurrency: int | None = Field(None, ge=0, description="pacing: requests in flight per worker (0: default)")
    pause_ms: int | None = Field(None, ge=0, description="pacing: the least pause between request waves")


class BodyLimit:
    """Refuse bodies over `limit` bytes with 413 before they are buffered whole."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await _too_large(self.limit)(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _BodyTooLarge()
            return message

        try:
            await self.app(scope, limited, send)
        except _BodyTooLarge:
            await _too_large(self.limit)(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


def _too_large(limit: int) -> JSONResponse:
    return JSONResponse({"error": "payload_too_large", "errors": [
        {"loc": ["body"], "msg": f"request bodies are limited to {limit} bytes"}]}, status_code=413)


def create_app(client: SendClient, store: StatusStore, keys: ApiKeys, limits: LimitStore,
               known_policies: frozenset[str], max_body: int = MAX_BODY_BYTES,
               guard: StateGuard | None = None, webhooks: WebhookIngest | None = None) -> FastAPI:
    """`guard` (checked at most every few seconds) rebuilds the API keys from the operator log
    when Redis has lost its data, so tenants keep publishing without an operator."""
    app = FastAPI(title="dual-rail dispatch ingest API", version="1",
                  description="Publish notification sends and read their status. "
                              f"Batches hold at most {MAX_BATCH} sends and are accepted or rejected whole.")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"loc": list(e["loc"]), "msg": e["msg"]} for e in flatten_errors(exc.errors())]
        status = 400 if any(e["msg"].startswith("JSON decode error") for e in errors) else 422
        metrics.INGEST_REJECTED.labels(str(status)).inc()
        return JSONResponse({"error": "invalid_request", "errors": errors}, status_code=status)

    def principal(request: Request) -> Principal:
        if guard is not None:
            try:
                guard.check()
            except StackError as exc:  # the operator log is unreadable: keys in Redis still work
                log.warning("cannot check Redis state against the operator log: %s", exc)
        auth = request.headers.get("authorization", "")
        token = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
        found = keys.resolve(token) if token else None
        if found is None:
            raise HTTPException(401, {"error": "unauthorized", "errors": [
                {"loc": ["header", "authorization"], "msg": "a valid API key is required (Bearer)"}]})
        return found

    def tenant(p: Annotated[Principal, Depends(principal)]) -> str:
        if p.role != "tenant" or not p.tenant:
            raise HTTPException(403, {"error": "forbidden", "errors": [
                {"loc": ["header", "authorization"], "msg": "sends are published with a tenant key"}]})
        return p.tenant

    def operator(p: Annotated[Principal, Depends(principal)]) -> Principal:
        if p.role != "operator":
            raise HTTPException(403, {"error": "forbidden", "errors": [
                {"loc": ["header", "authorization"], "msg": "limits are set by operators only"}]})
        return p

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        body = exc.detail if isinstance(exc.detail, dict) else {"error": str(exc.detail)}
        metrics.INGEST_REJECTED.labels(str(exc.status_code)).inc()
        return JSONResponse(body, status_code=exc.status_code)

    @app.exception_handler(StoreUnavailable)
    async def _store(request: Request, exc: StoreUnavailable) -> JSONResponse:
        # Nothing was published or changed: the client may retry after a moment.
        metrics.INGEST_REJECTED.labels("503").inc()
        return JSONResponse({"error": "unavailable", "errors": [{"loc": [], "msg": str(exc)}]}, status_code=503,
                            headers={"Retry-After": "1"})

    def _expand(tenant_id: str, req: SendRequest) -> tuple[Accepted, list[Send], list[tuple[Send, str]]]:
        """A send, or a webhook event fanned out to its subscribed endpoints: the deliveries to
        enqueue and those recorded as skipped (endpoint degraded, backlog shed)."""
        if req.channel != "webhook":
            send = build_send(req, tenant_id, routing=client.routing)
            return Accepted(send_id=send.send_id, lane=send.lane, deliveries=None), [send], []
        event_type = req.payload["event_type"]
        enqueue: list[Send] = []
        skipped: list[tuple[Send, str]] = []
        subscribed = []
        if webhooks is None:
            event_id = new_send_id()
        else:
            subscribed = webhooks.endpoints.subscribers(tenant_id, event_type)
            event_id, deliveries = fan_out(req, tenant_id, subscribed, client.routing)
            enqueue, skipped = webhooks.admit(deliveries)
        note = None if subscribed else (f"accepted with no delivery: no enabled endpoint of this tenant subscribes "
                                        f"to {event_type!r}")
        reasons = {d.send_id: reason for d, reason in skipped}
        return Accepted(send_id=event_id, lane=lane_for(req.category), note=note,
                        deliveries=[Delivery(delivery_id=d.send_id, endpoint_id=d.payload["endpoint_id"],
                                             skipped=reasons.get(d.send_id))
                                    for d in [*enqueue, *(s for s, _ in skipped)]]), enqueue, skipped

    def _publish(tenant_id: str, requests: list[SendRequest], batch: bool) -> list[Accepted]:
        # The schema checked every field; the policy name is checked against the policy file.
        errors = [e for i, r in enumerate(requests)
                  if (e := policy_error(r, known_policies, ("body", "sends", i) if batch else ("body",)))]
        if errors:
            raise HTTPException(422, {"error": "invalid_request", "errors": errors})
        expanded = [_expand(tenant_id, r) for r in requests]
        sends = [s for _, group, _ in expanded for s in group]
        skipped = [s for _, _, group in expanded for s in group]
        store.accepted(sends + [s for s, _ in skipped])
        try:
            if webhooks is not None:
                webhooks.record_skipped(skipped)
            client.publish_sends(sends)
        except PublishError as exc:
            raise HTTPException(503, {"error": "unavailable", "errors": [{"loc": [], "msg": str(exc)}]}) from None
        if webhooks is not None:
            webhooks.enqueued([s for s in sends if s.channel == "webhook"])
        for s in sends:
            metrics.INGESTED.labels(s.channel, s.lane).inc()
        return [accepted for accepted, _, _ in expanded]

    @app.post("/v1/sends", status_code=202, response_model=Accepted, response_model_exclude_none=True)
    def post_send(body: SendRequest, tenant_id: Annotated[str, Depends(tenant)]) -> Accepted:
        return _publish(tenant_id, [body], batch=False)[0]

    @app.post("/v1/sends/batch", status_code=202)
    def post_batch(body: BatchRequest, tenant_id: Annotated[str, Depends(tenant)]) -> dict:
        accepted = _publish(tenant_id, body.sends, batch=True)
        return {"accepted": len(accepted), "sends": [a.model_dump(exclude_none=True) for a in accepted]}

    if webhooks is not None:
        app.include_router(webhook_routes(webhooks, store, client, tenant))

    @app.get("/v1/sends/{send_id}")
    def get_send(send_id: str, tenant_id: Annotated[str, Depends(tenant)]) -> dict:
        doc = store.get(send_id)
        # Another tenant's send is indistinguishable from a missing one.
        if doc is None or doc.get("tenant_id") != tenant_id:
            raise HTTPException(404, {"error": "not_found", "errors": [
                {"loc": ["path", "send_id"], "msg": "no such send for this tenant"}]})
        return {"send_id": send_id, **{k: v for k, v in doc.items() if k in SEND_STATUS_FIELDS}}

    @app.get("/v1/admin/limits/{provider}")
    def get_limits(provider: str, _: Annotated[Principal, Depends(operator)]) -> dict:
        return {"provider": provider, "limits": limits.show(provider)}

    @app.put("/v1/admin/limits/{provider}")
    def put_limits(provider: str, body: LimitUpdate, _: Annotated[Principal, Depends(operator)]) -> dict:
        try:
            return {"provider": provider, "limits": limits.apply(provider, LimitChange(**body.model_dump()))}
        except ConfigError as exc:
            raise HTTPException(422, {"error": "invalid_request",
                                      "errors": [{"loc": ["body"], "msg": str(exc)}]}) from None

    from prometheus_client import make_asgi_app

    app.mount("/metrics", make_asgi_app())
    return BodyLimit(app, max_body)  # type: ignore[return-value]

