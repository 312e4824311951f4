"""`streams mock-endpoint`: a webhook receiver standing for the tenants' servers (dev tooling).

`POST /hooks/<name>` is an endpoint. It verifies the Standard Webhooks signature with the secrets
it was given (401 when none matches), counts deliveries by `webhook-id` (so duplicates show), and
answers as configured, at run time, per endpoint name or for all:

    POST /_mock/endpoints/<name>  {"secrets": [...], "status": 200, "latency_ms": 0, "timeout": false,
                                   "flap_every": 0, "retry_after": null}
    POST /_mock/defaults          the same fields, for names not configured
    GET  /_mock/stats[?deliveries=1]   POST /_mock/reset

`timeout` holds the request for 30 s (beyond any sender's timeout); `flap_every: n` fails every n-th
request with 500; `status: 410` is Gone; `status: 429` or `503` with `retry_after` asks to wait.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, fields, replace

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..webhooks.signing import InvalidSignature, verify


@dataclass(frozen=True)
class Behaviour:
    secrets: tuple[str, ...] = ()
    status: int = 200
    latency_ms: float = 0.0
    timeout: bool = False
    flap_every: int = 0
    retry_after: str | None = None


@dataclass
class Receiver:
    defaults: Behaviour = field(default_factory=Behaviour)
    behaviours: dict[str, Behaviour] = field(default_factory=dict)
    deliveries: dict[str, list[float]] = field(default_factory=dict)     # webhook-id -> receive times
    by_endpoint: dict[str, dict[str, int]] = field(default_factory=dict)  # name -> counters
    invalid_signatures: int = 0
    requests: int = 0

    def counters(self, name: str) -> dict[str, int]:
        return self.by_endpoint.setdefault(name, {"requests": 0, "ok": 0, "failed": 0, "invalid_signature": 0})


def _json(body: object, status: int = 200, headers: dict | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, headers=headers, media_type="application/json")


def _behaviour(current: Behaviour, change: dict) -> Behaviour:
    known = {f.name for f in fields(Behaviour)}
    unknown = set(change) - known
    if unknown:
        raise ValueError(f"unknown setting(s) {sorted(unknown)} (known: {sorted(known)})")
    if "secrets" in change:
        change = {**change, "secrets": tuple(change["secrets"] or ())}
    return replace(current, **change)


def _signed(headers, body: bytes, secret: str) -> bool:
    try:
        verify(headers, body, secret, now=time.time())
        return True
    except InvalidSignature:
        return False


def build_app() -> Starlette:
    state = Receiver()

    async def hook(request: Request) -> Response:
        st = state  # a request still sleeping when the receiver is reset counts in the old one, not the next test's
        name = request.path_params["name"]
        b = st.behaviours.get(name, st.defaults)
        c = st.counters(name)
        st.requests += 1
        c["requests"] += 1
        body = await request.body()
        if b.secrets and not any(_signed(request.headers, body, s) for s in b.secrets):
            st.invalid_signatures += 1
            c["invalid_signature"] += 1
            return _json({"error": "no valid signature"}, 401)
        if b.latency_ms:
            await asyncio.sleep(b.latency_ms / 1000)
        if b.timeout:
            await asyncio.sleep(30)
        status = b.status
        if b.flap_every and c["requests"] % b.flap_every == 0:
            status = 500
        if 200 <= status < 300:
            c["ok"] += 1
            st.deliveries.setdefault(request.headers.get("webhook-id", ""), []).append(time.time())
        else:
            c["failed"] += 1
        headers = {"retry-after": b.retry_after} if b.retry_after else None
        return _json({"ok": 200 <= status < 300}, status, headers)

    async def configure(request: Request) -> Response:
        try:
            change = orjson.loads(await request.body() or b"{}")
            name = request.path_params["name"]
            state.behaviours[name] = _behaviour(state.behaviours.get(name, state.defaults), change)
        except (ValueError, TypeError) as exc:
            return _json({"error": str(exc)}, 422)
        return _json({"endpoint": name, "behaviour": state.behaviours[name].__dict__})

    async def defaults(request: Request) -> Response:
        try:
            state.defaults = _behaviour(state.defaults, orjson.loads(await request.body() or b"{}"))
        except (ValueError, TypeError) as exc:
            return _json({"error": str(exc)}, 422)
        return _json({"defaults": state.defaults.__dict__})

    async def stats(request: Request) -> Response:
        dup = {k: len(v) for k, v in state.deliveries.items() if len(v) > 1}
        body: dict = {"requests": state.requests, "delivered": len(state.deliveries),
                      "duplicates": sum(n - 1 for n in dup.values()), "invalid_signatures": state.invalid_signatures,
                      "endpoints": state.by_endpoint}
        if request.query_params.get("deliveries") == "1":
            body["deliveries"] = state.deliveries
        return _json(body)

    async def reset(request: Request) -> Response:
        nonlocal state
        state = Receiver()
        return _json({"reset": True})

    return Starlette(routes=[
        Route("/hooks/{name}", hook, methods=["POST"]),
        Route("/_mock/endpoints/{name}", configure, methods=["POST"]),
        Route("/_mock/defaults", defaults, methods=["POST"]),
        Route("/_mock/stats", stats, methods=["GET"]),
        Route("/_mock/reset", reset, methods=["POST"]),
    ])


def serve(host: str, port: int) -> None:
    import uvicorn

    uvicorn.run(build_app(), host=host, port=port, log_level="warning", access_log=False,
                limit_concurrency=10_000, backlog=4096,
                timeout_graceful_shutdown=1)  # requests held by `timeout` do not hold the shutdown
