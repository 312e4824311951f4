"""A webhook delivery ingest records as skipped is never attempted, so nothing but ingest itself ever
says so: when Redis stops right after the publish, its status must still arrive, through notif.outcomes
and the outcome recorder, once Redis is back."""

import asyncio

import httpx

from streams.ingest.api import Ingest, create_app
from streams.ingest.status import StatusStore
from streams.runtime import Runtime
from tests.harness import wait_until, webhook_event


def test_a_delivery_skipped_while_redis_fails_after_the_publish_is_still_listed_as_skipped(
        fault_stack, fault_env, fault_topics, fault_processes, names):
    """Given the ingest API (in this process) on a private stack, with backlog limits of 1 undelivered delivery,
    an endpoint of tenant acme with one delivery already waiting (no webhook worker runs), and Redis stopped
    just after the broker acknowledged the next event's publish,
    When acme publishes that event (its delivery is skipped: backlog_shed), and Redis and the outcome recorder
    then start,
    Then the request is accepted, and the delivery is recorded `skipped` (backlog_shed) and listed under its
    endpoint. Before, ingest wrote the skipped outcome to Redis first and published it only if that worked,
    so the outage left the delivery without any status: not listed, and not replayable through the API."""
    fault_topics("webhook")
    rt = Runtime.from_env({**fault_env, "WEBHOOK_BACKLOG_MAX_COUNT": "1", "WEBHOOK_BACKLOG_MAX_AGE_S": "0",
                           "WEBHOOK_REQUIRE_HTTPS": "0", "WEBHOOK_ALLOW_HOSTS": "127.0.0.1"})
    r = rt.redis()
    client, store = rt.send_client(), StatusStore(r, rt.namespace)
    webhooks = rt.webhook_ingest(r, client, store)
    webhooks.follow()
    app = create_app(Ingest(client, store, rt.api_keys(r), rt.limit_store(r), frozenset(rt.policies()),
                            webhooks=webhooks))
    key = {"Authorization": f"Bearer {rt.api_keys(r).create('tenant', 'acme')}"}
    real_publish = client.publisher.publish_async

    async def publish_then_redis_stops(records):
        written = await real_publish(records)
        if any(rec.topic == names.webhook_skipped for rec in records):
            fault_stack.stop_redis()
        return written

    client.publisher.publish_async = publish_then_redis_stops

    async def scenario() -> tuple[str, str, int]:
        transport = httpx.ASGITransport(app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://api", headers=key, timeout=30) as api:
            created = await api.post("/v1/endpoints", json={"url": "http://127.0.0.1:9/hook",
                                                            "event_types": ["invoice.paid"]})
            assert created.status_code == 201, created.text
            endpoint_id = created.json()["id"]
            first = await api.post("/v1/sends", json=webhook_event())
            assert first.status_code == 202 and "skipped" not in first.json()["deliveries"][0], first.text
            second = await api.post("/v1/sends", json=webhook_event())
            return endpoint_id, second.json()["deliveries"][0] if second.status_code == 202 else {}, second

    try:
        endpoint_id, delivery, answer = asyncio.run(scenario())
        assert answer.status_code == 202, answer.text
        assert delivery["skipped"] == "backlog_shed", answer.text
        assert fault_stack.local.redis.pid() is None, "Redis was stopped after the publish"

        fault_stack.start_redis()
        fault_processes.start("outcome-recorder", "outcome-recorder", ready="outcome recorder consuming")
        doc = wait_until(lambda: store.get(delivery["delivery_id"]), 60,
                         "the skipped delivery's status to be recorded")
        assert (doc["status"], doc["reason"]) == ("skipped", "backlog_shed"), doc
        assert delivery["delivery_id"] in [d for d, _ in store.endpoint_deliveries(endpoint_id, "acme")]
    finally:
        webhooks.stop()
        rt.close()
