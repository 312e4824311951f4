"""The Python SDK for a tenant's webhook endpoints and deliveries (over the ingest API).

    from streams.webhooks.client import WebhooksClient
    hooks = WebhooksClient("https://dispatch.example.com", api_key)
    ep = hooks.create_endpoint("https://acme.example/hooks", ["invoice.paid"])   # ep["secret"] shown once
    hooks.send_event("invoice.paid", {"id": 7}, occurred_at="2026-11-30T12:00:00Z", idempotency_key="invoice-7-paid")

Errors come back as WebhooksApiError with the API's status and its `errors` list.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx

from ..errors import DispatchError
from ..providers.connections import KEEPALIVE_S


class WebhooksApiError(DispatchError):
    def __init__(self, status: int, body: Any):
        self.status, self.body = status, body
        errors = body.get("errors") if isinstance(body, dict) else None
        super().__init__(f"{status}: {errors or body}")


class WebhooksClient:
    def __init__(self, base_url: str, api_key: str, timeout_s: float = 30.0):
        # An idle connection goes before the API's server (uvicorn: 5 s) closes it, so no call is sent on a
        # connection the server is closing at that moment (it would fail, "Server disconnected").
        self.http = httpx.Client(base_url=base_url, timeout=timeout_s,
                                 limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S),
                                 headers={"Authorization": f"Bearer {api_key}"})

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        r = self.http.request(method, path, **kwargs)
        if r.status_code >= 400:
            try:
                body: Any = r.json()
            except ValueError:
                body = r.text
            raise WebhooksApiError(r.status_code, body)
        return None if r.status_code == 204 else r.json()

    def create_endpoint(self, url: str, event_types: list[str], description: str = "", enabled: bool = True) -> dict:
        return self._call("POST", "/v1/endpoints", json={"url": url, "event_types": event_types,
                                                          "description": description, "enabled": enabled})

    def endpoints(self) -> list[dict]:
        return self._call("GET", "/v1/endpoints")["endpoints"]

    def endpoint(self, endpoint_id: str) -> dict:
        return self._call("GET", f"/v1/endpoints/{endpoint_id}")

    def update_endpoint(self, endpoint_id: str, **changes: Any) -> dict:
        return self._call("PATCH", f"/v1/endpoints/{endpoint_id}", json=changes)

    def delete_endpoint(self, endpoint_id: str) -> None:
        self._call("DELETE", f"/v1/endpoints/{endpoint_id}")

    def rotate_secret(self, endpoint_id: str) -> str:
        return self._call("POST", f"/v1/endpoints/{endpoint_id}/rotate-secret")["secret"]

    def send_event(self, event_type: str, data: dict, occurred_at: str, category: str = "transactional",
                   idempotency_key: str | None = None) -> dict:
        """Publish an event; the answer lists one delivery per subscribed endpoint. With `idempotency_key` (one per
        event, e.g. "invoice-7-paid"), sending it again after a timeout or a 503 `"outcome": "unknown"` is the same
        event: the first answer, the same delivery ids, nothing delivered twice. Without one, a retry is another
        event, delivered again under new ids."""
        return self._call("POST", "/v1/sends", json={"channel": "webhook", "category": category, "payload": {
            "event_type": event_type, "occurredAt": occurred_at, "data": data}},
            headers={"Idempotency-Key": idempotency_key} if idempotency_key else None)

    def deliveries(self, endpoint_id: str, limit: int = 100) -> list[dict]:
        """The endpoint's newest `limit` deliveries (one page; `all_deliveries` reads them all)."""
        return self._call("GET", f"/v1/endpoints/{endpoint_id}/deliveries", params={"limit": limit})["deliveries"]

    def all_deliveries(self, endpoint_id: str, page_size: int = 100) -> Iterator[dict]:
        """Every delivery to the endpoint, newest first, a page at a time."""
        params: dict[str, Any] = {"limit": page_size}
        while True:
            page = self._call("GET", f"/v1/endpoints/{endpoint_id}/deliveries", params=params)
            yield from page["deliveries"]
            if page.get("next_cursor") is None:  # an API of before cursors answers none: its one page
                return
            params["cursor"] = page["next_cursor"]

    def delivery(self, delivery_id: str) -> dict:
        return self._call("GET", f"/v1/deliveries/{delivery_id}")

    def replay(self, delivery_id: str) -> dict:
        return self._call("POST", f"/v1/deliveries/{delivery_id}/replay")

    def replay_endpoint(self, endpoint_id: str, since_ms: int, until_ms: int | None = None) -> dict:
        return self._call("POST", f"/v1/endpoints/{endpoint_id}/replay",
                          json={"since_ms": since_ms, "until_ms": until_ms})
