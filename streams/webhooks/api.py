"""The webhook part of the ingest API (tenant keys): endpoints, their deliveries, replays.

    POST   /v1/endpoints                      register (the signing secret is shown once)
    GET    /v1/endpoints                      list;  GET/PATCH/DELETE /v1/endpoints/{id}
    POST   /v1/endpoints/{id}/rotate-secret   a new secret; the previous one stays valid 24 h
    POST   /v1/endpoints/{id}/reactivate      back to active after degradation (or a 410): counter and alerts reset
    GET    /v1/endpoints/{id}/deliveries      its deliveries, newest first (30 days)
    POST   /v1/endpoints/{id}/replay          replay its failed deliveries in a time range (bounded, idempotent)
    GET    /v1/deliveries/{id}                a delivery with its attempts
    POST   /v1/deliveries/{id}/replay         a new delivery (new webhook-id) carrying replay_of
    PUT    /v1/members, GET /v1/members       the project's members: endpoint alert emails go to them

Another tenant's endpoint or delivery is indistinguishable from a missing one (404).
"""

import base64
import functools
import logging
import time
from collections.abc import Callable, Collection
from typing import Annotated, Any, Literal

from confluent_kafka import KafkaException
from fastapi import APIRouter, Depends, HTTPException, Query, Response
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from ..errors import (
    BrokerUnavailable,
    ConfigError,
    PublishError,
    PublishOutcomeUnknown,
    ReplayNotYet,
    ReplayOutcomeUnknown,
    ReplayRefused,
    StoreUnavailable,
)
from ..ingest.quotas import BeyondBurst, IngestQuotas, OverQuota
from ..ingest.sdk import SendClient
from ..ingest.status import StatusStore
from ..ingest.web import ReplayedDelivery, documented, problem
from ..retry.replay import replay
from ..send import EMAIL_PATTERN, EVENT_TYPE_PATTERN, MAX_RECIPIENTS, Send
from .endpoints import MAX_EVENT_TYPES, MAX_URL_LENGTH
from .ingest import WebhookIngest, reactivated_in_part
from .model import Endpoint

log = logging.getLogger("streams.webhooks.api")
MAX_BULK_REPLAY = 1000
MAX_BULK_CONSIDERED = 10_000  # deliveries one bulk replay call looks at (each is a status read); the next call goes on
DELIVERY_FIELDS = ("status", "endpoint_id", "event_id", "event_type", "attempts", "accepted_at_ms",
                   "completed_at_ms", "reason", "replay_of", "replayed_as", "attempt_history")


# Documented as check_event_types checks them (at run time, a 422 from the endpoint store).
EventTypes = Annotated[list[str], WithJsonSchema({
    "type": "array", "minItems": 1, "maxItems": MAX_EVENT_TYPES,
    "items": {"type": "string", "pattern": f"{EVENT_TYPE_PATTERN}|^[*]$"},
    "description": "event types it receives ('*' for all)"})]
URL = ("https URL the deliveries are POSTed to (a public address: private, loopback and link-local addresses are "
       "refused, and the host must resolve)")


class EndpointCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(description=URL, max_length=MAX_URL_LENGTH)
    event_types: EventTypes = Field(min_length=1)
    description: str = Field("", description="kept up to 500 characters")
    enabled: bool = True


class EndpointUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str | None = Field(None, description=URL, max_length=MAX_URL_LENGTH)
    event_types: EventTypes | None = None
    description: str | None = None
    enabled: bool | None = None


class Members(BaseModel):
    model_config = ConfigDict(extra="forbid")
    emails: list[str] = Field(description=f"every member's email address (at most {MAX_RECIPIENTS}); alerts go to "
                                          "all of them",
                              json_schema_extra={"maxItems": MAX_RECIPIENTS,
                                                 "items": {"type": "string", "pattern": EMAIL_PATTERN}})


class EndpointView(BaseModel):
    """An endpoint as its tenant sees it (never its secrets)."""

    id: str
    tenant: str
    url: str
    event_types: list[str]
    description: str
    enabled: bool
    state: str = Field(description="active, degraded or disabled")
    state_reason: str
    created_at_ms: int


class EndpointCreated(EndpointView):
    secret: str = Field(description="the signing secret, shown once")


class EndpointReactivated(EndpointView):
    note: str


class EndpointList(BaseModel):
    endpoints: list[EndpointView]


class SecretRotated(BaseModel):
    secret: str = Field(description="the new signing secret, shown once")
    previous_valid_until_ms: int


class MemberList(BaseModel):
    emails: list[str]


class DeliveryView(BaseModel):
    """A delivery and its attempts (the fields its outcomes have recorded so far)."""

    model_config = ConfigDict(extra="allow")
    delivery_id: str
    status: str | None = None
    endpoint_id: str | None = None
    event_id: str | None = None
    event_type: str | None = None
    attempts: int | None = None
    accepted_at_ms: int | None = None
    completed_at_ms: int | None = None
    reason: str | None = None
    replay_of: str | None = None
    replayed_as: str | None = None
    attempt_history: list[dict[str, Any]] | None = None


class DeliveryList(BaseModel):
    deliveries: list[DeliveryView]
    next_cursor: str | None = Field(description="pass as `cursor` for the next page; null: this page is the last")


class RefusedDelivery(BaseModel):
    delivery_id: str
    msg: str = Field(description="why it cannot be replayed (its payload expired, ...)")


class BulkReplayed(BaseModel):
    replayed: list[ReplayedDelivery]
    already_replayed: int
    refused: list[RefusedDelivery] = Field(description="deliveries that cannot be replayed (not asked again)")
    considered: int = Field(description="deliveries of the range this call looked at, oldest first")
    next_since_ms: int | None = Field(None, description=f"set when deliveries of the range remain that this call did "
                                      f"not look at (it stopped at `limit` replays, or at {MAX_BULK_CONSIDERED} "
                                      "deliveries looked at): call again with this since_ms for the rest")


class BulkReplay(BaseModel):
    model_config = ConfigDict(extra="forbid")
    since_ms: int = Field(description="replay deliveries created at or after this time (Unix ms)")
    until_ms: int | None = Field(None, description="... and before this time (default: now)")
    # Final outcomes only: a delivery still under way is refused by the replay, and a refusal keeps its claim,
    # which would keep it out of every later bulk replay once it had ended.
    statuses: list[Literal["delivered", "dropped", "skipped", "dead_lettered"]] = Field(
        default=["dropped", "skipped"], min_length=1, description="which final outcomes to replay")
    limit: int = Field(MAX_BULK_REPLAY, ge=1, le=MAX_BULK_REPLAY)


def _not_found(what: str) -> HTTPException:
    return problem(404, "not_found", ["path", f"{what}_id"], f"no such {what} for this tenant")


def _invalid(exc: Exception) -> HTTPException:
    return problem(422, "invalid_request", ["body"], str(exc))


class ReplayOverQuota(Exception):
    """A replay the tenant's ingest quotas refuse: nothing of it is published. Over a quota: 429 with Retry-After;
    beyond a burst (it can never pass, whenever asked): 422, as ingest answers."""

    def __init__(self, verdict: OverQuota | BeyondBurst):
        self.verdict = verdict
        super().__init__(str(verdict) if isinstance(verdict, OverQuota)
                         else f"the {verdict.quota} quota's burst can never admit it: {verdict.message}")

    def http(self, what_was_done: str, **detail: Any) -> HTTPException:
        body = {"errors": [{"loc": ["header", "authorization"], "msg": f"{self}; {what_was_done}"}], **detail}
        if isinstance(self.verdict, BeyondBurst):
            return HTTPException(422, {"error": "quota_burst_exceeded", **body})
        return HTTPException(429, {"error": "quota_exceeded", **body},
                             headers={"Retry-After": self.verdict.retry_after})


def webhook_routes(webhooks: WebhookIngest, store: StatusStore, client: SendClient,
                   tenant: Callable[..., str], quotas: IngestQuotas | None = None) -> APIRouter:
    router = APIRouter(tags=["webhooks"])
    Tenant = Annotated[str, Depends(tenant)]  # noqa: N806 - a type alias
    endpoints = webhooks.endpoints

    def charged(tenant_id: str, request: bool) -> Callable[[Send], Callable[[], None]] | None:
        """A replay publishes a send as `POST /v1/sends` does, so the tenant's ingest quotas charge it (each
        delivery a bulk replay publishes charges its lane; its request is charged once, up front)."""
        if quotas is None:
            return None

        def admit(send: Send) -> Callable[[], None]:
            verdict = quotas.admit(tenant_id, [send], request)
            if verdict is not None:
                raise ReplayOverQuota(verdict)
            return lambda: quotas.give_back_request(tenant_id, [send], request)
        return admit

    def shown(ep: Endpoint) -> dict:
        return webhooks.current(ep).public()

    def refuse_unless_deliverable(ep: Endpoint | None, loc: list[str | int]) -> None:
        """A replay to an endpoint that takes no deliveries would be skipped by the worker, and its original marked
        replayed all the same (a bulk replay asked again passes it over): refused, nothing replayed."""
        current = webhooks.current(ep) if ep is not None else None
        if current is not None and current.deliverable:
            return
        why = ("its endpoint was deleted" if current is None else
               f"endpoint {current.id} is disabled: enable it (PATCH enabled=true)" if not current.enabled else
               f"endpoint {current.id} is {current.state}: reactivate it (POST /v1/endpoints/{current.id}/reactivate)"
               "; it takes deliveries again within a few seconds (GET shows state active)")
        raise problem(409, "endpoint_not_deliverable", loc, f"{why}, then replay; nothing was replayed")

    @router.post("/v1/endpoints", status_code=201, response_model=EndpointCreated,
                 responses=documented(401, 403, 422, 503))
    async def create_endpoint(body: EndpointCreate, tenant_id: Tenant) -> dict:
        # The URL's host is looked up on the event loop; only the store's work takes one of the API's threads.
        resolve = await endpoints.url_resolver(body.url)

        def create() -> dict:
            try:
                ep, secret = endpoints.create(tenant_id, body.url, body.event_types, body.description, body.enabled,
                                              resolve=resolve)
            except ConfigError as exc:
                raise _invalid(exc) from None
            return {**shown(ep), "secret": secret}

        return await run_in_threadpool(create)

    @router.get("/v1/endpoints", response_model=EndpointList, responses=documented(401, 403, 503))
    def list_endpoints(tenant_id: Tenant) -> dict:
        return {"endpoints": [shown(e) for e in endpoints.all(tenant_id)]}

    @router.get("/v1/endpoints/{endpoint_id}", response_model=EndpointView, responses=documented(401, 403, 404, 503))
    def get_endpoint(endpoint_id: str, tenant_id: Tenant) -> dict:
        ep = endpoints.get(tenant_id, endpoint_id)
        if ep is None:
            raise _not_found("endpoint")
        return shown(ep)

    @router.patch("/v1/endpoints/{endpoint_id}", response_model=EndpointView,
                  responses=documented(401, 403, 404, 422, 503))
    async def update_endpoint(endpoint_id: str, body: EndpointUpdate, tenant_id: Tenant) -> dict:
        resolve = await endpoints.url_resolver(body.url) if body.url is not None else None

        def update() -> dict:
            try:
                ep = endpoints.update(tenant_id, endpoint_id, **body.model_dump(), resolve=resolve)
            except ConfigError as exc:
                raise _invalid(exc) from None
            if ep is None:
                raise _not_found("endpoint")
            return shown(ep)

        return await run_in_threadpool(update)

    @router.delete("/v1/endpoints/{endpoint_id}", status_code=204, responses=documented(401, 403, 404, 503))
    def delete_endpoint(endpoint_id: str, tenant_id: Tenant) -> Response:
        if not endpoints.delete(tenant_id, endpoint_id):
            raise _not_found("endpoint")
        return Response(status_code=204)

    @router.post("/v1/endpoints/{endpoint_id}/rotate-secret", response_model=SecretRotated,
                 responses=documented(401, 403, 404, 503))
    def rotate_secret(endpoint_id: str, tenant_id: Tenant) -> dict:
        now_ms = int(time.time() * 1000)
        secret = endpoints.rotate_secret(tenant_id, endpoint_id, now_ms)
        if secret is None:
            raise _not_found("endpoint")
        return {"secret": secret, "previous_valid_until_ms": now_ms + 24 * 3600 * 1000}

    @router.post("/v1/endpoints/{endpoint_id}/reactivate", response_model=EndpointReactivated,
                 responses=documented(401, 403, 404, 503))
    def reactivate(endpoint_id: str, tenant_id: Tenant) -> dict:
        """Back to active: deliveries resume, the failure counter and the alert window are reset (a
        second incident the same day gets its own alert). Events skipped meanwhile can be replayed
        (POST /v1/endpoints/{id}/replay)."""
        ep = webhooks.set_active(tenant_id, endpoint_id)
        if ep is None:
            raise _not_found("endpoint")
        try:
            webhooks.reset_health(tenant_id, endpoint_id)
        except PublishError:
            raise problem(503, "unavailable", [], reactivated_in_part(webhooks.current(ep).state),
                          {"Retry-After": "1"}, outcome="applied") from None
        return {**shown(ep), "note": "the endpoint receives deliveries again within a few seconds (its state shows "
                                     "active then): replay what it missed once it does"}

    @router.put("/v1/members", response_model=MemberList, responses=documented(401, 403, 422, 503))
    def put_members(body: Members, tenant_id: Tenant) -> dict:
        try:
            return {"emails": list(webhooks.members.set(tenant_id, body.emails))}
        except ConfigError as exc:
            raise _invalid(exc) from None

    @router.get("/v1/members", response_model=MemberList, responses=documented(401, 403, 503))
    def get_members(tenant_id: Tenant) -> dict:
        return {"emails": list(webhooks.members.get(tenant_id))}

    @router.get("/v1/endpoints/{endpoint_id}/deliveries", response_model=DeliveryList,
                responses=documented(401, 403, 404, 422, 503))
    def endpoint_deliveries(endpoint_id: str, tenant_id: Tenant, limit: Annotated[int, Query(ge=1, le=500)] = 100,
                            cursor: Annotated[str | None, Query(description=(
                                "the `next_cursor` of the page before: the page after it"))] = None,
                            before_ms: Annotated[int | None, Query(description=(
                                "deliveries created before this time (ms); page on with `cursor`"))] = None) -> dict:
        if cursor is not None and before_ms is not None:
            raise problem(422, "invalid_request", ["query", "cursor"], "give cursor or before_ms, not both")
        after = _read_cursor(cursor) if cursor is not None else None
        if endpoints.get(tenant_id, endpoint_id) is None:
            raise _not_found("endpoint")
        found = store.endpoint_deliveries(endpoint_id, tenant_id, limit + 1, before_ms, after)
        page = found[:limit]
        deliveries = [_delivery(d, doc) for d, _ in page if (doc := store.get(d)) and doc.get("tenant_id") == tenant_id]
        if not deliveries:  # none because Redis lost its data, not yet recovered: 503, not an empty list
            store.require_data()
        return {"deliveries": deliveries, "next_cursor": _cursor(page[-1]) if len(found) > limit else None}

    @router.post("/v1/endpoints/{endpoint_id}/replay", status_code=202, response_model=BulkReplayed,
                 responses=documented(401, 403, 404, 409, 422, 429, 503))
    def replay_endpoint(endpoint_id: str, body: BulkReplay, tenant_id: Tenant) -> dict:
        """Replay the endpoint's deliveries with one of `statuses` created in [since_ms, until_ms):
        at most `limit`, each at most once however often this is called (a receiver fixed its bug
        and asks again for what it missed)."""
        ep = endpoints.get(tenant_id, endpoint_id)
        if ep is None:
            raise _not_found("endpoint")
        until = int(time.time() * 1000) if body.until_ms is None else body.until_ms
        if body.since_ms >= until:
            raise problem(422, "invalid_request", ["body", "since_ms"],
                          f"since_ms {body.since_ms} is not before until_ms {until}: no delivery is in that range")
        refuse_unless_deliverable(ep, ["path", "endpoint_id"])
        if quotas is not None and (verdict := quotas.admit(tenant_id, [])) is not None:  # the request itself
            raise ReplayOverQuota(verdict).http("nothing was replayed by this call", replayed=[])
        admit = charged(tenant_id, request=False)

        def replay_it(delivery_id: str) -> Send:
            return replay(client.bootstrap, client.names, store, client, delivery_id, tenant=tenant_id, admit=admit)

        def give_back_the_request() -> None:
            """A call that fails having published nothing (for sure) is charged nothing, as `POST /v1/sends`."""
            if quotas is not None:
                quotas.give_back_request(tenant_id, [])

        try:
            listed = store.endpoint_deliveries_between(endpoint_id, tenant_id, body.since_ms, until,
                                                       MAX_BULK_CONSIDERED + 1)
            if not listed:  # none because Redis lost its data, not yet recovered: 503, not "nothing to replay"
                store.require_data()
        except StoreUnavailable:
            give_back_the_request()
            raise
        candidates = [d for d, _ in listed[:MAX_BULK_CONSIDERED]]
        try:
            answer = replay_in_turn(store, candidates, tenant_id, body.statuses, body.limit, replay_it)
            return {**answer, "next_since_ms": next_since(listed, answer["considered"])}
        except BulkReplayStopped as stop:
            if not stop.replayed and not isinstance(stop.cause, (ReplayOutcomeUnknown, PublishOutcomeUnknown)):
                give_back_the_request()
            raise _stopped(stop) from None

    @router.get("/v1/deliveries/{delivery_id}", response_model=DeliveryView, responses=documented(401, 403, 404, 503))
    def get_delivery(delivery_id: str, tenant_id: Tenant) -> dict:
        doc = store.get(delivery_id)
        if not doc or doc.get("tenant_id") != tenant_id or not doc.get("endpoint_id"):
            store.require_data()  # missing because Redis lost its data, not yet recovered: 503, not 404
            raise _not_found("delivery")
        return _delivery(delivery_id, doc)

    @router.post("/v1/deliveries/{delivery_id}/replay", status_code=202, response_model=ReplayedDelivery,
                 responses=documented(401, 403, 404, 409, 410, 422, 429, 503))
    def replay_delivery(delivery_id: str, tenant_id: Tenant, outcome_checked: bool = False) -> dict:
        """A new delivery with a new webhook-id. 409 for one dead-lettered `unknown_outcome` unless
        `outcome_checked=true`: the receiver may have it already."""
        doc = store.get(delivery_id)
        if not doc or doc.get("tenant_id") != tenant_id or not doc.get("endpoint_id"):
            raise _not_found("delivery")
        refuse_unless_deliverable(endpoints.get(tenant_id, str(doc["endpoint_id"])), ["path", "delivery_id"])

        try:
            new = replay(client.bootstrap, client.names, store, client, delivery_id, tenant=tenant_id,
                         outcome_checked=outcome_checked, admit=charged(tenant_id, request=True), alone=True)
        except ReplayOverQuota as over:
            raise over.http("nothing was replayed") from None
        except ReplayRefused as exc:
            raise HTTPException(410 if "expired" in str(exc) else 409, {"error": "replay_refused", "errors": [
                {"loc": ["path", "delivery_id"], "msg": str(exc)}]}) from None
        except ReplayOutcomeUnknown as exc:  # its replay marked left pending: a bulk replay passes it over
            raise problem(503, "unavailable", [], f"the message broker did not confirm the replay: it may have been "
                          f"published as delivery {exc.replay_id}; look it up (GET /v1/deliveries/{exc.replay_id}) "
                          "before replaying again", {"Retry-After": "1"}, outcome="unknown") from None
        return {"delivery_id": new.send_id, "replay_of": delivery_id}

    return router


class BulkReplayStopped(Exception):
    """A bulk replay stopped by a failure after it had replayed `replayed`; `delivery_id`: the tenant's
    delivery it stopped at (None when it stopped before knowing whose the next one was)."""

    def __init__(self, replayed: list[dict], delivery_id: str | None, cause: Exception):
        super().__init__(f"stopped at {delivery_id or 'a delivery not yet checked'}: {cause!r}")
        self.replayed, self.delivery_id, self.cause = replayed, delivery_id, cause


CLAIM_KEPT = "the replay claim could not be freed"


def next_since(listed: list[tuple[str, int]], considered: int) -> int | None:
    """Where a bulk replay's next call starts: the creation time of the first delivery of `listed` (oldest first,
    with their creation times) that this call did not look at; None when it looked at them all. Deliveries
    created in that same millisecond that it did look at are looked at again, and answer as already replayed."""
    return listed[considered][1] if considered < len(listed) else None


def replay_in_turn(store: StatusStore, candidates: list[str], tenant_id: str, statuses: Collection[str], limit: int,
                   replay_it: Callable[[str], Send]) -> dict:
    """The bulk replay's answer: the tenant's `candidates` with one of `statuses`, each replayed once (see
    `replay_once`), up to `limit`. Any failure other than a refusal for good stops it there, raised as
    BulkReplayStopped, which carries what it did replay (those are published: the answer must name them)."""
    replayed: list[dict] = []
    refused: list[dict] = []
    already = considered = 0
    for delivery_id in candidates:
        if len(replayed) >= limit:
            break
        considered += 1
        checked: str | None = None  # named in an answer only once known to be the tenant's
        try:
            doc = store.get(delivery_id)
            if not doc or doc.get("tenant_id") != tenant_id or doc.get("status") not in statuses:
                continue
            checked = delivery_id
            new = replay_once(store, delivery_id, functools.partial(replay_it, delivery_id))
        except ReplayRefused as exc:  # for good (an expired payload: its claim stays), or until checked
            refused.append({"delivery_id": delivery_id, "msg": str(exc)})
            continue
        except Exception as exc:  # noqa: BLE001 - whatever stops it, the answer names what was published
            raise BulkReplayStopped(replayed, checked, exc) from exc
        if new is None:
            already += 1
            continue
        replayed.append({"delivery_id": new.send_id, "replay_of": delivery_id})
    return {"replayed": replayed, "already_replayed": already, "refused": refused, "considered": considered}


def _stopped(stop: BulkReplayStopped) -> HTTPException:
    """503 (a dependency failed) or 500 (anything else) naming what this call replayed before it stopped;
    calling again goes on from there (a delivery is never replayed twice). Never the failure's own text
    (it can name internal hosts)."""
    cause, at = stop.cause, f"delivery {stop.delivery_id}" if stop.delivery_id else "the next delivery"
    done = (f"the {len(stop.replayed)} deliveries in `replayed` were replayed by this call" if stop.replayed
            else "nothing else was replayed by this call")
    kept = (f"; {at} stays marked as being replayed, so bulk replays skip it: replay it with "
            f"POST /v1/deliveries/{stop.delivery_id}/replay"
            if stop.delivery_id and CLAIM_KEPT in getattr(cause, "__notes__", ()) else "")
    if isinstance(cause, ReplayOverQuota):  # refused before its publish: call again once it allows, for the rest
        return cause.http(f"at {at}; {done}{kept}", replayed=stop.replayed)
    status, error = 503, "unavailable"
    if isinstance(cause, ReplayOutcomeUnknown):
        msg = (f"the message broker did not confirm the replay of {at}: it may have been published as delivery "
               f"{cause.replay_id} (look it up before replaying it again); {done}; call again after a moment for "
               "the rest")
    elif isinstance(cause, (PublishError, BrokerUnavailable, StoreUnavailable, KafkaException)):
        dependency = "state store" if isinstance(cause, StoreUnavailable) else "message broker"
        msg = f"the {dependency} did not answer at {at}; {done}; call again after a moment for the rest"
    else:
        status, error = 500, "internal_error"
        msg = f"replaying {at} failed unexpectedly (logged); {done}"
    msg += kept
    detail: dict[str, Any] = {"error": error, "errors": [{"loc": [], "msg": msg}], "replayed": stop.replayed}
    if isinstance(cause, PublishOutcomeUnknown):
        detail["outcome"] = "unknown"
    if status == 500:
        log.error("bulk replay stopped after %d replays", len(stop.replayed), exc_info=cause)
    else:
        log.warning("bulk replay stopped after %d replays: %s", len(stop.replayed), stop)
    return HTTPException(status, detail, headers={"Retry-After": "1"} if status == 503 else None)


def replay_once(store: StatusStore, delivery_id: str, do_replay: Callable[[], Send]) -> Send | None:
    """A bulk replay's step: `do_replay()` unless a bulk replay did already (None). Its claim stays once the
    replay may have been published, also when the broker left that unknown (asked again, a bulk replay
    must not replay it twice), and when it was refused for good; any other failure (reading the payload,
    an unknown outcome not yet checked with the provider,
    a publish with nothing published) frees it for the next call (when that fails, the failure carries
    the note CLAIM_KEPT). `do_replay` raises nothing once it has published, nor does this after it."""
    if not store.claim_replay(delivery_id):
        return None
    try:
        new = do_replay()
    except PublishOutcomeUnknown:
        raise
    except BaseException as failure:
        if isinstance(failure, ReplayRefused) and not isinstance(failure, ReplayNotYet):
            raise  # for good: its claim stays (an unknown outcome is refused only until the provider is checked)
        try:
            store.release_replay(delivery_id)
        except StoreUnavailable as exc:  # the failure itself is the answer; the claim stays (never twice)
            log.warning("the replay claim of %s was not freed: %s", delivery_id, exc)
            failure.add_note(CLAIM_KEPT)
        raise
    try:
        store.mark_replayed(delivery_id, new.send_id)
    except StoreUnavailable as exc:  # published: the answer names it; the claim stays (never replayed twice)
        log.warning("the replay %s of %s is published, but not recorded as its replay: %s", new.send_id,
                    delivery_id, exc)
    return new


def _cursor(last: tuple[str, int]) -> str:
    """Where the next page starts: after the (time, id) of the last delivery of this one, opaque to callers."""
    delivery_id, created_ms = last
    return base64.urlsafe_b64encode(f"{created_ms}:{delivery_id}".encode()).decode().rstrip("=")


def _read_cursor(cursor: str) -> tuple[int, str]:
    try:
        text = base64.b64decode(cursor + "=" * (-len(cursor) % 4), b"-_", validate=True).decode()
        created_ms, _, delivery_id = text.partition(":")
        if delivery_id and created_ms.isdigit():
            return int(created_ms), delivery_id
    except ValueError:  # not base64, not UTF-8
        pass
    raise problem(422, "invalid_request", ["query", "cursor"], "not a cursor this API gave: pass a page's "
                                                                "next_cursor as it came")


def _delivery(delivery_id: str, doc: dict) -> dict:
    return {"delivery_id": delivery_id, **{k: v for k, v in doc.items() if k in DELIVERY_FIELDS}}
