"""The operator API (operator keys only; a tenant key gets 403 on every route):

    GET/PUT /v1/admin/limits/{provider}          dispatch limits, pacing, and ingest quotas (ingest-*)
    DELETE /v1/admin/limits/{p}/tenants/{t}      a tenant's own limit removed (the default '*' holds it again)
    GET/DELETE /v1/admin/limits/{p}/cooldown     what is left of a provider's 429 cool-down / ending it
    GET/POST /v1/admin/keys                      list keys (never the keys themselves) / create one
    POST /v1/admin/keys/{id}/revoke              refused from now on, by every API process
    POST /v1/admin/keys/{id}/rotate              a new key; the old one stays valid for `overlap_s`
    GET  /v1/admin/dlq, GET /v1/admin/dlq/{id}   dead letters, newest last / one with its headers
    POST /v1/admin/dlq/{id}/replay               a new send with the dead letter's payload (replay_of)
    POST /v1/admin/endpoints/{id}/reactivate     a degraded or disabled webhook endpoint, back to active
    GET  /v1/admin/senders                       the sender domains in force (operators' and SENDER_DOMAINS)
    PUT/DELETE /v1/admin/senders/{tenant}        a tenant's (or `*`'s) sender domains / back to the setting's
    GET  /v1/admin/audit                         the audit trail

Every change is written to the audit trail (`notif.audit`: who, what, before, after, when) before
it is answered. A change the trail did not confirm is applied all the same: it is counted
(`dispatch_audit_records_unconfirmed_total`), logged, and answered 503 `"outcome": "applied"` when
making it again records it without changing more (limits, a revocation, a reactivation), else as done.
"""


import collections
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query
from fastapi import Path as FastApiPath
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from .. import metrics
from ..errors import (
    ConfigError,
    PublishError,
    PublishOutcomeUnknown,
    ReplayOutcomeUnknown,
    ReplayRefused,
    StateLost,
    StoreUnavailable,
    StoreWriteUnknown,
)
from ..gate.limits import MAX_LIMIT, MIN_RATE, LimitChange, cool_down_ended, cool_down_subject
from ..retry import dlq as dead_letters
from ..retry.replay import replay_dead_letter as replay_dead_letter_once
from ..send import TENANT_ID_PATTERN
from ..webhooks.api import EndpointView
from ..webhooks.endpoints import EndpointViewBehind
from ..webhooks.ingest import reactivated_in_part
from .api_keys import Principal, public
from .api_keys import key_id as id_of
from .quotas import QUOTAS
from .sender_store import SenderDomainStore
from .senders import DOMAIN_PATTERN, MAX_DOMAINS
from .web import documented, problem

log = logging.getLogger("streams.operator_api")

TENANT_LIMIT = ("tenant", "tenant_rate", "tenant_burst")
# How long a reactivation by endpoint id waits for this process's endpoint view to read one created a moment ago.
ENDPOINT_VIEW_SYNC_S = 5.0


class LimitUpdate(BaseModel):
    """A partial update. A global rate or burst needs the other too while the provider has none yet, and
    `reserve` must stay below the global burst: the answer is 422 otherwise."""

    # A tenant's limit is the tenant, its rate and its burst together (or none of them).
    model_config = ConfigDict(extra="forbid", json_schema_extra={"anyOf": [
        {"properties": {name: {"type": "null"} for name in TENANT_LIMIT}},
        {"properties": {name: {"not": {"type": "null"}} for name in TENANT_LIMIT}, "required": list(TENANT_LIMIT)}]})
    global_rate: float | None = Field(None, ge=MIN_RATE, le=MAX_LIMIT,
                                      description="tokens a second; a fraction is one every 1/rate seconds")
    global_burst: int | None = Field(None, ge=1, le=MAX_LIMIT)
    reserve: int | None = Field(None, ge=0, le=MAX_LIMIT)
    tenant: str | None = Field(None, description="a tenant id, or '*' for the default",
                               json_schema_extra={"minLength": 1})
    tenant_rate: float | None = Field(None, ge=MIN_RATE, le=MAX_LIMIT,
                                      description="tokens a second; a fraction is one every 1/rate seconds")
    tenant_burst: int | None = Field(None, ge=1, le=MAX_LIMIT)
    concurrency: int | None = Field(None, ge=0, le=10_000,
                                    description="pacing: requests in flight per worker (0: the provider's default)")
    pause_ms: int | None = Field(None, ge=0, le=60_000, description="pacing: the least pause between request waves")


class KeyCreate(BaseModel):
    # Documented: a tenant key names its tenant (an operator key's `tenant` is ignored).
    model_config = ConfigDict(extra="forbid", json_schema_extra={"anyOf": [
        {"properties": {"role": {"const": "operator"}}},
        {"properties": {"role": {"const": "tenant"}, "tenant": {"type": "string", "pattern": TENANT_ID_PATTERN}},
         "required": ["tenant"]}]})
    role: str = Field(pattern="^(tenant|operator)$", json_schema_extra={"enum": ["tenant", "operator"]})
    tenant: str | None = Field(None, description="required for a tenant key: 1 to 64 ASCII letters, digits, '_' "
                                                 "or '-'")
    label: str = Field("", max_length=100)


class KeyRotate(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt field would leave a leaked key working a day
    overlap_s: int = Field(24 * 3600, ge=0, le=30 * 24 * 3600, description="how long the old key keeps working")


SENDER_TENANT_PATTERN = r"^(\*|[A-Za-z0-9_-]{1,64})$"


DOMAIN_SCHEMA = {"type": "string", "pattern": DOMAIN_PATTERN, "maxLength": 253}


class SenderDomainsUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Checked by the store, which names each refused domain and why; the schema publishes the same rule.
    domains: list[Annotated[str, WithJsonSchema(DOMAIN_SCHEMA)]] = Field(
        max_length=MAX_DOMAINS, description="the domains the tenant may send email from (subdomains included; "
                                            "ASCII, an internationalised one in its xn-- form; any case, a final "
                                            "dot allowed); none: it may send no email")


class TenantSenderDomains(BaseModel):
    tenant: str = Field(description="a tenant id, or '*' for tenants without an entry of their own")
    domains: list[str]


class SenderDomainsView(BaseModel):
    enforced: bool = Field(description="false: no rule anywhere, any sender is accepted")
    stored: dict[str, list[str]] = Field(description="set by operators; each overrides the setting's entry")
    setting: dict[str, list[str]] = Field(description="SENDER_DOMAINS of this API process")


class Limits(BaseModel):
    provider: str
    limits: dict[str, int | float] = Field(description="global_rate, global_burst, reserve, tenant_rate:<tenant>, "
                                               "tenant_burst:<tenant>, concurrency, pause_ms (those set)")


class CoolDown(BaseModel):
    provider: str
    left_s: float = Field(description="seconds left of the provider-wide hold a 429 set (0: none); on DELETE, what "
                                      "was left when it was ended")


class KeyView(BaseModel):
    """An API key as operators see it (never the key itself)."""

    id: str
    role: str
    tenant: str | None
    created_at_ms: int
    expires_at_ms: int | None = Field(description="a rotated key: valid until then")
    revoked_at_ms: int | None
    last_used_ms: int | None
    label: str


class Keys(BaseModel):
    keys: list[KeyView]


class KeyCreated(BaseModel):
    id: str
    key: str = Field(description="shown once")
    role: str
    tenant: str | None
    note: str


class KeyRotated(BaseModel):
    id: str
    key: str = Field(description="the new key, shown once")
    previous: KeyView
    note: str


class DeadLetter(BaseModel):
    send_id: str
    reason: str
    partition: int
    offset: int
    dead_lettered_at_ms: int
    headers: dict[str, str]


class DeadLetters(BaseModel):
    total: int
    dead_letters: list[DeadLetter]


class Replayed(BaseModel):
    send_id: str = Field(description="the new send")
    replay_of: str
    earlier: bool = Field(False, description="true: an earlier call replayed it as `send_id`; nothing was "
                                             "published now")


class AuditEntry(BaseModel):
    at_ms: int
    who: str
    what: str
    before: Any
    after: Any


class AuditTrail(BaseModel):
    entries: list[AuditEntry]


def operator_routes(ingest, operator: Callable[..., Principal]) -> APIRouter:  # ingest: api.Ingest
    router = APIRouter(prefix="/v1/admin", tags=["operators"])
    Operator = Annotated[Principal, Depends(operator)]  # noqa: N806 - a type alias
    client, store = ingest.client, ingest.store

    def recorded(who: Principal, what: str, before: object, after: object, applied: str) -> bool:
        """On the audit trail; False when the broker did not confirm the record (counted, and logged as `what`
        `applied`, "was applied" or "may have been applied")."""
        if ingest.audit is None:
            return True
        try:
            ingest.audit.record(f"key:{who.key_id}", what, before, after)
            return True
        except PublishError as exc:
            metrics.AUDIT_RECORDS_UNCONFIRMED.labels(what.split("/", 1)[0]).inc()
            log.error("%s %s, but the audit trail did not confirm its record: %s", what, applied, exc)
            return False

    def audited(who: Principal, what: str, before: object, after: object, repeatable: bool = True) -> None:
        """Record a change, applied already, on the audit trail. When the broker does not confirm the record,
        the change stays applied, and is counted and logged: a repeatable change (applied again it changes
        nothing more, and is recorded) is answered 503 `"outcome": "applied"`; one that cannot be repeated
        (a new key, a rotation, a replay: again would be another) is answered as done."""
        if not recorded(who, what, before, after, "was applied") and repeatable:
            raise problem(503, "unavailable", [], "the change was applied, but the audit trail did not confirm "
                          "its record; make the same change again to record it", {"Retry-After": "1"},
                          outcome="applied")

    def audited_maybe(who: Principal, what: str, before: object, intended: object) -> None:
        """A change that cannot be repeated whose store or broker did not answer: it may have been applied, and made
        again it finds nothing to do and records nothing. On the audit trail as such, best effort (the caller is
        answered 503 for the failure itself)."""
        recorded(who, what, before, {"outcome": "unknown", "intended": intended}, "may have been applied")

    @contextlib.contextmanager
    def audited_if_unanswered(who: Principal, what: str, before: object, intended: object,
                              unanswered: type[Exception] = StoreWriteUnknown) -> Iterator[None]:
        """The change made inside, whose store did not answer (`unanswered`), is audited as maybe applied, then its
        error is the answer (503)."""
        try:
            yield
        except unanswered:
            audited_maybe(who, what, before, intended)
            raise

    def one_of(names: list[str], provider: str, missing: str) -> str:
        if provider not in names:
            raise problem(404, "not_found", ["path", "provider"], missing)
        return provider

    def known(provider: str) -> str:
        """A provider of providers.toml or an ingest quota (a misspelt one would be accepted and govern nothing)."""
        names = [*sorted(ingest.registry.providers), *QUOTAS]
        return one_of(names, provider, f"no provider or quota {provider!r} (known: {', '.join(names)})")

    @router.get("/limits/{provider}", response_model=Limits, responses=documented(401, 403, 404, 503))
    def get_limits(provider: str, _: Operator) -> dict:
        try:
            return {"provider": provider, "limits": ingest.limits.show(known(provider))}
        except ConfigError as exc:  # a field edited by hand into no number: named, with the change that mends it
            raise problem(503, "limits_unreadable", [], str(exc)) from None

    @router.put("/limits/{provider}", response_model=Limits, responses=documented(401, 403, 404, 422, 503))
    def put_limits(provider: str, body: LimitUpdate, who: Operator) -> dict:
        change = LimitChange(**body.model_dump())
        try:
            # Redis may have applied it before its answer was lost (the operator log then holds it): a retry would
            # record the new limits as what they replaced.
            with audited_if_unanswered(who, f"limits/{provider}", None, body.model_dump(exclude_none=True)):
                before, after, _ = ingest.limits.apply(known(provider), change)
        except ConfigError as exc:
            raise problem(422, "invalid_request", ["body"], str(exc)) from None
        audited(who, f"limits/{provider}", before, after)
        return {"provider": provider, "limits": after}

    @router.delete("/limits/{provider}/tenants/{tenant}", response_model=Limits,
                   responses=documented(401, 403, 404, 422, 503))
    def unset_tenant_limit(provider: str, tenant: Annotated[str, FastApiPath(pattern=TENANT_ID_PATTERN)],
                           who: Operator) -> dict:
        """Remove the tenant's own limit: it is held to the default ('*') again (already none: nothing changes)."""
        try:
            with audited_if_unanswered(who, f"limits/{provider}", None, {"unset_tenant": tenant}):
                before, after, _ = ingest.limits.apply(known(provider), LimitChange(unset_tenant=tenant))
        except ConfigError as exc:
            raise problem(422, "invalid_request", ["path", "tenant"], str(exc)) from None
        audited(who, f"limits/{provider}", before, after)
        return {"provider": provider, "limits": after}

    def a_provider(provider: str) -> str:
        """A provider with a provider-wide cool-down (not an ingest quota, not the webhook provider)."""
        names = ingest.registry.with_cool_down()
        return one_of(names, provider, f"no provider-wide cool-down for {provider!r} "
                                       f"(providers that have one: {', '.join(names)})")

    OwnAccount = Annotated[str | None, Query(pattern=TENANT_ID_PATTERN, description=(
        "a tenant sending under an account of its own at the provider: that account's hold, not the shared one's"))]

    @router.get("/limits/{provider}/cooldown", response_model=CoolDown, responses=documented(401, 403, 404, 422, 503))
    def get_cool_down(provider: str, _: Operator, tenant: OwnAccount = None) -> dict:
        return {"provider": provider, "left_s": ingest.limits.cool_down_left(a_provider(provider), tenant)}

    @router.delete("/limits/{provider}/cooldown", response_model=CoolDown,
                   responses=documented(401, 403, 404, 422, 503))
    def end_cool_down(provider: str, who: Operator, tenant: OwnAccount = None) -> dict:
        """End the provider-wide hold a 429 set (a quota's Retry-After: up to a day), once the provider takes
        requests again (its quota was raised); workers send again within 10 s. `tenant`: the hold of that
        tenant's own account at the provider."""
        with audited_if_unanswered(who, cool_down_subject(provider, tenant), None, {"cool_down_left_s": 0},
                                   StoreUnavailable):
            left = ingest.limits.clear_cool_down(a_provider(provider), tenant)
        if left:
            # Not repeatable: ended again, it finds none, and there is nothing more to record.
            audited(who, *cool_down_ended(provider, left, tenant), repeatable=False)
        return {"provider": provider, "left_s": left}

    @router.get("/keys", response_model=Keys, responses=documented(401, 403, 503))
    def list_keys(_: Operator, tenant: str | None = None) -> dict:
        return {"keys": [public(k) for k in ingest.keys.list(tenant)]}

    @router.post("/keys", status_code=201, response_model=KeyCreated, responses=documented(401, 403, 422, 503))
    def create_key(body: KeyCreate, who: Operator) -> dict:
        try:
            token = ingest.keys.create(body.role, body.tenant, body.label)
        except ConfigError as exc:
            raise problem(422, "invalid_request", ["body", "tenant"], str(exc)) from None
        # The key's id from the key itself (asking Redis again could fail after the key exists: it would be lost
        # to its caller and unaudited); its tenant as stored (an operator key has none, whatever the body said).
        tenant = body.tenant if body.role == "tenant" else None
        audited(who, f"apikey/{id_of(token)}", None, {"role": body.role, "tenant": tenant, "label": body.label},
                repeatable=False)
        return {"id": id_of(token), "key": token, "role": body.role, "tenant": tenant,
                "note": "the key is shown once: store it now"}

    @router.post("/keys/{key_id}/revoke", response_model=KeyView, responses=documented(401, 403, 404, 503))
    def revoke_key(key_id: str, who: Operator) -> dict:
        before = ingest.keys.get(key_id)
        after = ingest.keys.revoke(key_id)
        if before is None or after is None:
            raise problem(404, "not_found", ["path", "key_id"], "no such key")
        audited(who, f"apikey/{key_id}", public(before), public(after))
        return public(after)

    @router.post("/keys/{key_id}/rotate", status_code=201, response_model=KeyRotated,
                 responses=documented(401, 403, 404, 422, 503))
    def rotate_key(key_id: str, body: KeyRotate, who: Operator) -> dict:
        before = ingest.keys.get(key_id)
        # Unanswered, the old key's end may be set (its new key is revoked): not repeatable as such.
        with audited_if_unanswered(who, f"apikey/{key_id}", public(before) if before else None,
                                   {"rotated": True, "overlap_s": body.overlap_s}):
            rotated = ingest.keys.rotate(key_id, body.overlap_s)
        if before is None or rotated is None:
            raise problem(404, "not_found", ["path", "key_id"], "no such key that is still valid")
        token, old = rotated
        audited(who, f"apikey/{key_id}", public(before), {"old": public(old), "new_id": id_of(token)}, repeatable=False)
        return {"id": id_of(token), "key": token, "previous": public(old),
                "note": "the key is shown once: store it now"}

    @router.get("/dlq", response_model=DeadLetters, responses=documented(401, 403, 422, 503))
    def list_dead_letters(_: Operator, reason: str | None = None,
                          limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> dict:
        listing = dead_letters.latest(client.bootstrap, client.names.dlq, limit, reason)
        return {"total": listing.total, "dead_letters": [_letter(r) for r in listing.latest]}

    @router.get("/dlq/{send_id}", response_model=DeadLetter, responses=documented(401, 403, 404, 503))
    def show_dead_letter(send_id: str, _: Operator) -> dict:
        status = store.get(send_id) or {}
        position = (status["dlq_partition"], status["dlq_offset"]) if "dlq_offset" in status else None
        try:
            record = dead_letters.find(client.bootstrap, client.names.dlq, send_id, position)
        except ReplayRefused as exc:
            raise problem(404, "not_found", ["path", "send_id"], str(exc)) from None
        return _letter(record)

    @router.post("/dlq/{send_id}/replay", status_code=202, response_model=Replayed,
                 responses=documented(401, 403, 404, 409, 422, 503))
    def replay_dead_letter(send_id: str, who: Operator, outcome_checked: bool = False) -> dict:
        """A new send with the dead letter's payload, once: asked again (another operator, a retry after a
        timeout) it answers the same send id with `earlier: true`. 409 for a send that is not a dead letter
        (a delivered one), for one dead-lettered `unknown_outcome` unless `outcome_checked=true` (the
        provider may hold it: check there first), and for a webhook delivery whose endpoint takes no deliveries
        (deleted, disabled, degraded: the worker would skip the replay)."""
        try:
            webhooks = ingest.webhooks
            done = replay_dead_letter_once(client.bootstrap, client.names, store, client, send_id, outcome_checked,
                                           admit=webhooks.refuse_undeliverable_replay if webhooks else None)
        except ReplayRefused as exc:
            code = 404 if str(exc).startswith("no send") else 409
            raise problem(code, "replay_refused", ["path", "send_id"], str(exc)) from None
        except StateLost as exc:  # says what the operator does (recover), which the plain 503 would not
            raise problem(503, "unavailable", [], str(exc), {"Retry-After": "1"}) from None
        except PublishError as exc:  # unknown: the answer names the new send id, to look up before replaying
            log.warning("replay of %s: %s", send_id, exc)  # the broker's own error: logged, not answered
            if isinstance(exc, ReplayOutcomeUnknown):
                audited_maybe(who, f"replay/{send_id}", None, {"send_id": exc.replay_id, "replay_of": send_id})
                detail = (f"the message broker did not confirm the replay of {send_id}: it may have been published "
                          f"as {exc.replay_id}; look that send up (`streams sends show {exc.replay_id}`) before "
                          "replaying again")
            elif isinstance(exc, PublishOutcomeUnknown):
                detail = (f"the message broker did not confirm the replay of {send_id}: look the send up (`streams "
                          f"sends show {send_id}`, its replayed_as) before replaying again")
            else:
                detail = f"the message broker did not take the replay of {send_id}: nothing was published; try again"
            raise problem(503, "unavailable", [], detail, {"Retry-After": "1"},
                          outcome="unknown" if isinstance(exc, PublishOutcomeUnknown) else None) from None
        if done.send is None:
            return {"send_id": done.send_id, "replay_of": send_id, "earlier": True}
        audited(who, f"replay/{send_id}", None, {"send_id": done.send_id, "replay_of": send_id}, repeatable=False)
        return {"send_id": done.send_id, "replay_of": send_id}

    @router.post("/endpoints/{endpoint_id}/reactivate", response_model=EndpointView,
                 responses=documented(401, 403, 404, 503))
    def reactivate_endpoint(endpoint_id: str, who: Operator) -> dict:
        webhooks = ingest.webhooks
        if webhooks is None:
            raise problem(404, "not_found", ["path", "endpoint_id"], "no such endpoint")
        # Its tenant from this process's endpoint view, which waits to have read an endpoint created a moment ago;
        # its state as stored now: the view may not have read a 410's disable yet (the audit would say active).
        try:
            seen = webhooks.directory.find(endpoint_id, ENDPOINT_VIEW_SYNC_S)
        except EndpointViewBehind as exc:
            log.warning("reactivation of endpoint %s: %s", endpoint_id, exc)
            raise problem(503, "unavailable", [], "this process's view of the webhook endpoints is behind; retry "
                          "after a moment", {"Retry-After": "1"}) from None
        stored = webhooks.endpoints.get(seen.tenant, endpoint_id) if seen else None
        if stored is None:
            raise problem(404, "not_found", ["path", "endpoint_id"], "no such endpoint")
        before = webhooks.current(stored).public()
        with audited_if_unanswered(who, f"endpoint/{endpoint_id}", {"state": before["state"]}, {"state": "active"}):
            ep = webhooks.set_active(stored.tenant, endpoint_id)
        if ep is None:
            raise problem(404, "not_found", ["path", "endpoint_id"], "no such endpoint")
        try:
            webhooks.reset_health(stored.tenant, endpoint_id)
        except PublishError as exc:
            # Its configured state is active already (a 410's disable lifted): on the audit trail too, as it now
            # stands (degraded while the endpoint-health app holds it so), with the error.
            log.warning("endpoint %s: configured state active again, its health reset not confirmed: %s",
                        endpoint_id, exc)
            now = webhooks.current(ep).state
            also = ""
            try:
                audited(who, f"endpoint/{endpoint_id}", {"state": before["state"]},
                        {"state": now, "error": type(exc).__name__})
            except HTTPException:  # counted and logged there; this answer says both
                also = "; its audit record was not confirmed either"
            raise problem(503, "unavailable", [], reactivated_in_part(now) + also, {"Retry-After": "1"},
                          outcome="applied") from None
        audited(who, f"endpoint/{endpoint_id}", {"state": before["state"]}, {"state": "active"})
        return ep.public()

    def sender_store() -> SenderDomainStore:
        if not isinstance(ingest.senders, SenderDomainStore):
            raise problem(503, "unavailable", [], "this API process has fixed sender domains")
        return ingest.senders

    @router.get("/senders", response_model=SenderDomainsView, responses=documented(401, 403, 503))
    def list_sender_domains(_: Operator) -> dict:
        store = sender_store()
        stored = store.stored()
        setting = {t: sorted(d) for t, d in store.setting.by_tenant.items()}
        return {"enforced": bool(stored) or store.setting.enforced, "stored": stored, "setting": setting}

    @router.put("/senders/{tenant}", response_model=TenantSenderDomains, responses=documented(401, 403, 422, 503))
    def put_sender_domains(tenant: Annotated[str, FastApiPath(pattern=SENDER_TENANT_PATTERN)],
                           body: SenderDomainsUpdate, who: Operator) -> dict:
        store = sender_store()
        padded = [d for d in body.domains if d != d.strip()]
        if padded:  # the published pattern allows none (SENDER_DOMAINS and the CLI strip it)
            raise problem(422, "invalid_request", ["body", "domains"],
                          f"domains: {', '.join(map(repr, padded[:5]))}: white space around a domain")
        before = store.stored().get(tenant)
        try:
            after = store.set(tenant, body.domains)
        except ConfigError as exc:
            raise problem(422, "invalid_request", ["body", "domains"], str(exc)) from None
        audited(who, f"senders/{tenant}", before, after)
        return {"tenant": tenant, "domains": after}

    @router.delete("/senders/{tenant}", response_model=TenantSenderDomains,
                   responses=documented(401, 403, 404, 422, 503))
    def delete_sender_domains(tenant: Annotated[str, FastApiPath(pattern=SENDER_TENANT_PATTERN)],
                              who: Operator) -> dict:
        store = sender_store()
        before = store.stored().get(tenant)
        with audited_if_unanswered(who, f"senders/{tenant}", before, None, StoreUnavailable):
            removed = store.remove(tenant)
        if not removed:
            raise problem(404, "not_found", ["path", "tenant"], "no sender domains set by an operator for this tenant")
        # Not repeatable: the same DELETE again finds nothing, is answered 404 and records nothing.
        audited(who, f"senders/{tenant}", before, None, repeatable=False)
        return {"tenant": tenant, "domains": before or []}

    @router.get("/audit", response_model=AuditTrail, responses=documented(401, 403, 422, 503))
    def read_audit(_: Operator, since_ms: int = 0, limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> dict:
        # The newest `limit` kept as the trail is read (a year of it, held whole, for every call)
        entries = collections.deque(ingest.audit.read(since_ms), maxlen=limit) if ingest.audit is not None else []
        return {"entries": list(entries)}

    return router


def _letter(record: dead_letters.DeadLetterRecord) -> dict:
    """A dead letter as operators see it: its headers (reason, attempts, origin, errors), redacted, never its
    payload."""
    return {"send_id": dead_letters.shown_send_id(record.send_id), "reason": record.reason,
            "partition": record.partition, "offset": record.offset, "dead_lettered_at_ms": record.timestamp_ms,
            "headers": dead_letters.redacted_headers(record)}

