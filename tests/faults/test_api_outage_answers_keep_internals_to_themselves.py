"""Redis, then the broker, stopped under the ingest API: every caller, with a key or without one (the
keys live in Redis, so none can be checked), gets 503 with Retry-After and the kind of dependency that
failed, never the error text with internal hosts, ports or topics; the operator finds that in the
log. Once the dependency is back, the same request is accepted."""

from tests.harness import answers, email_request, free_port, local_client, wait_until


def test_a_store_outage_is_answered_503_without_the_stores_address(fault_stack, fault_runtime, fault_topics,
                                                                   fault_processes):
    """Given the ingest API on a private stack and a tenant's key,
    When Redis is stopped and the tenant, and a caller with a key nobody issued, post a send,
    Then both get 503 with Retry-After: 1 saying the state store is unavailable, and neither body names the
    store's address (which the API's log does); once Redis is back the tenant's send is accepted."""
    fault_topics("email")
    fault_processes.env["KAFKA_DELIVERY_TIMEOUT_MS"] = "3000"  # the API gives up on the broker after 3 s
    api_key = fault_runtime.api_keys().create("tenant", "shop")
    port = free_port()
    fault_processes.start("api", "api", "--port", str(port))
    base = f"http://127.0.0.1:{port}"
    tenant = local_client(base_url=base, timeout=30, headers={"Authorization": f"Bearer {api_key}"})
    stranger = local_client(base_url=base, timeout=30, headers={"Authorization": "Bearer dr_not_a_key"})
    wait_until(lambda: answers(tenant), 30, "the ingest API")
    redis_port = str(fault_stack.redis().connection_pool.connection_kwargs["port"])

    fault_stack.stop_redis()
    for caller in (tenant, stranger):
        r = caller.post("/v1/sends", json=email_request())
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["errors"][0]["msg"] == "the state store is unavailable; retry after a moment"
        assert redis_port not in r.text and "127.0.0.1" not in r.text, r.text
    api_log = next(log for name, _, log in fault_processes.procs if name == "api").read_text(errors="replace")
    assert "503 on POST /v1/sends" in api_log and redis_port in api_log, "the operator's log says what failed"

    fault_stack.start_redis()
    accepted = wait_until(lambda: (r := tenant.post("/v1/sends", json=email_request())).status_code == 202 and r,
                          30, "the API to accept the send again", interval=0.5)
    assert accepted.json()["send_id"]

    fault_stack.stop_kafka()
    r = tenant.post("/v1/sends", json=email_request())
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    # Its acknowledgement timed out: the client cannot tell a stopped broker from a stalled one that still writes it.
    assert r.json()["errors"][0]["msg"].startswith("the message broker did not confirm the publish: it may have")
    assert "without an Idempotency-Key" in r.json()["errors"][0]["msg"], r.text  # this caller sent none
    assert r.json()["outcome"] == "unknown", r.text
    assert "notif." not in r.text and "127.0.0.1" not in r.text, r.text
    fault_stack.start_kafka()
    wait_until(lambda: (r := tenant.post("/v1/sends", json=email_request())).status_code == 202 and r,
               60, "the API to accept a send once the broker is back", interval=1.0)
