"""A publish the broker did not confirm in time may still be written: the broker stalled, not gone, reads
what reached it once it runs again. The API answers such a request 503 with `"outcome": "unknown"` and
keeps its Idempotency-Key bound to the request's send ids, so the client's retry publishes the same ids
and dispatch sends each once. Were the key freed as after a refusal, the retry would publish new ids
next to the stalled attempt's, and the same emails would go out twice."""

import threading
import time
import uuid

import httpx

from tests.harness import answers, email_request, free_port, local_client, read_committed, wait_until

BATCH = 5


def send_ids_by_correlation(bootstrap: str, topic: str) -> dict[str, set[str]]:
    """Every send id a read-committed consumer reads in `topic`, by the request's correlation id."""
    ids: dict[str, set[str]] = {}
    for event in read_committed(bootstrap, topic):
        ids.setdefault(event["correlation_id"], set()).add(event["send_id"])
    return ids


def uuid7_ms(send_id: str) -> int:
    """The Unix milliseconds a send id (a UUIDv7) was made for: an idempotent request's first attempt."""
    return int(uuid.UUID(send_id).hex[:12], 16)


def test_a_send_and_a_batch_the_broker_did_not_confirm_are_retried_under_the_same_send_ids(
        fault_stack, fault_runtime, fault_topics, fault_processes, names):
    """Given the ingest API on a private stack (publish timeout lowered to 5 s),
    When the broker stalls (SIGSTOP) while a tenant posts a send and a batch of 5, each with an Idempotency-Key,
    Then the send is answered 503 with `"outcome": "unknown"` (its record reached the broker, unacknowledged), the
    batch 503 too, "unknown" if its commit was asked or "not published" if its records failed first and the
    transaction was aborted; once the broker runs again, the same requests under the same keys are accepted, an
    unknown one with send ids made at the first attempt (not at the retry), and every record of them in the lane,
    the stalled attempt's included, carries exactly the send id answered for its position: nothing of the first
    attempt is left under an id dispatch would send a second time."""
    fault_topics("email")
    api_key = fault_runtime.api_keys().create("tenant", "shop")
    port = free_port()
    fault_processes.start("api", "api", "--port", str(port), env={"KAFKA_DELIVERY_TIMEOUT_MS": "5000"})
    api = local_client(base_url=f"http://127.0.0.1:{port}", timeout=90, headers={"Authorization": f"Bearer {api_key}"})
    wait_until(lambda: answers(api), 30, "the ingest API")
    # The producers have their connections before the stall (what a stall meets in production).
    assert api.post("/v1/sends/batch", json={"sends": [email_request()] * 2}).status_code == 202
    assert api.post("/v1/sends", json=email_request()).status_code == 202

    single = {**email_request(), "correlation_id": "single"}
    batch = {"sends": [{**email_request(), "correlation_id": f"batch-{i}"} for i in range(BATCH)]}
    requests = {"single": ("/v1/sends", single, "key-single"), "batch": ("/v1/sends/batch", batch, "key-batch")}
    first: dict[str, httpx.Response] = {}

    def post(name: str) -> None:
        path, body, key = requests[name]
        first[name] = api.post(path, json=body, headers={"Idempotency-Key": key})

    started_ms = int(time.time() * 1000)
    fault_stack.freeze_kafka()
    try:
        posters = [threading.Thread(target=post, args=(name,)) for name in requests]
        for p in posters:
            p.start()
        for p in posters:
            p.join(90)
    finally:
        fault_stack.thaw_kafka()
    answered_ms = int(time.time() * 1000)

    assert set(first) == set(requests)
    for name, r in first.items():
        assert r.status_code == 503 and r.headers["retry-after"] == "1", (name, r.text)
        assert "same Idempotency-Key" in r.json()["errors"][0]["msg"], (name, r.text)
    assert first["single"].json().get("outcome") == "unknown", first["single"].text
    unknown = [name for name, r in first.items() if r.json().get("outcome") == "unknown"]

    def accepted(name: str) -> httpx.Response | None:
        path, body, key = requests[name]
        r = api.post(path, json=body, headers={"Idempotency-Key": key})
        return r if r.status_code == 202 else None

    single_id = wait_until(lambda: accepted("single"), 90, "the send to be accepted again", interval=1.0
                           ).json()["send_id"]
    batch_ids = [s["send_id"] for s in wait_until(lambda: accepted("batch"), 90, "the batch to be accepted again",
                                                   interval=1.0).json()["sends"]]
    # Read until the accepted batch's records are read (a broker just back from its stall once gave a reader
    # ends that left them out); records never read fail here after the wait.
    lane = wait_until(lambda: (ids := send_ids_by_correlation(fault_stack.bootstrap, names.lane(
        "email", "transactional"))) and all(f"batch-{i}" in ids for i in range(len(batch_ids))) and ids, 60,
        "the accepted requests' records to be read in the lane", interval=1.0)
    assert lane["single"] == {single_id}, lane["single"]
    for i, send_id in enumerate(batch_ids):
        assert lane[f"batch-{i}"] == {send_id}, (i, lane[f"batch-{i}"])
    for send_id in [single_id, *(batch_ids if "batch" in unknown else [])]:
        assert started_ms <= uuid7_ms(send_id) <= answered_ms, \
            f"{send_id} was made at the retry, not at the first attempt: the stalled attempt's ids are others"
