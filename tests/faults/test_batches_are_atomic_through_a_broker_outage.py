"""Batches are published all or nothing, also when the broker stops in the middle of them.

A producer without transactions, stopped halfway through a batch, leaves the first half in the lane
while the API answers 503: the client retries and the first half is published twice. With a producer
transaction per request, a batch the broker did not commit is never read by the workers (they read
committed records only), and the answer says which happened."""

import threading
import time

import httpx

from tests.harness import answers, email_request, free_port, local_client, read_committed, wait_until

BATCH = 20
UNKNOWN = -1  # answered 503 with `"outcome": "unknown"`: the broker stopped while the batch's commit was asked


def committed_by_batch(bootstrap: str, topic: str) -> dict[str, int]:
    """How many records of each batch (correlation id prefix) a read-committed consumer reads."""
    counts: dict[str, int] = {}
    for event in read_committed(bootstrap, topic):
        batch = event["correlation_id"].split("-")[0]
        counts[batch] = counts.get(batch, 0) + 1
    return counts


def test_a_broker_outage_in_the_middle_of_batches_leaves_each_batch_whole_or_absent(
        fault_stack, fault_runtime, fault_topics, fault_processes, names):
    """Given the ingest API on a private stack (publish timeout lowered to 5 s) and a client posting batches of 20
    transactional emails back to back,
    When the broker is stopped for 15 s while batches are being posted, then started again,
    Then every batch answered 202 is in the lane whole, exactly once, and every batch answered otherwise is not in
    the lane at all (not one of its sends), except one answered 503 with `"outcome": "unknown"` (its commit was
    asked as the broker stopped, and could not be aborted: the broker may complete it) or not answered, which is
    whole or absent: no batch is ever half published, and no answer says "not published" of a published one."""
    fault_topics("email")
    api_key = fault_runtime.api_keys().create("tenant", "shop")
    port = free_port()
    fault_processes.start("api", "api", "--port", str(port), env={"KAFKA_DELIVERY_TIMEOUT_MS": "5000"})
    api = local_client(base_url=f"http://127.0.0.1:{port}", timeout=60, headers={"Authorization": f"Bearer {api_key}"})
    wait_until(lambda: answers(api), 30, "the ingest API")
    answered: dict[str, int] = {}
    stop = threading.Event()

    def post_batches() -> None:
        n = 0
        while not stop.is_set():
            batch = f"b{n}"
            body = {"sends": [{**email_request(), "correlation_id": f"{batch}-{i}"} for i in range(BATCH)]}
            try:
                r = api.post("/v1/sends/batch", json=body)
                unknown = r.status_code == 503 and r.json().get("outcome") == "unknown"
                answered[batch] = UNKNOWN if unknown else r.status_code
            except httpx.TransportError:
                answered[batch] = 0  # no answer: the client cannot know, the lane must still be whole or empty
            n += 1

    poster = threading.Thread(target=post_batches, daemon=True)
    poster.start()
    wait_until(lambda: sum(1 for s in answered.values() if s == 202) >= 10, 30, "batches accepted before the outage")
    fault_stack.stop_kafka()
    stopped = time.monotonic()
    wait_until(lambda: any(s != 202 for s in answered.values()), 60, "a batch refused during the outage")
    time.sleep(max(0.0, 15 - (time.monotonic() - stopped)))  # the outage lasts 15 s by definition
    fault_stack.start_kafka()
    accepted_before = sum(1 for s in answered.values() if s == 202)
    wait_until(lambda: sum(1 for s in answered.values() if s == 202) >= accepted_before + 10, 120,
               "batches accepted again after the outage", interval=0.5)
    stop.set()
    poster.join(90)

    counts = committed_by_batch(fault_stack.bootstrap, names.lane("email", "transactional"))
    refused = [b for b, s in answered.items() if s != 202]
    print(f"{len(answered)} batches: {len(answered) - len(refused)} accepted, {len(refused)} refused or unanswered "
          f"({sorted(set(answered.values()))}); half-published: "
          f"{[b for b, n in counts.items() if n not in (0, BATCH)]}")
    assert refused, "the outage refused no batch: it tested nothing"
    for batch, status in answered.items():
        if status == 202:
            assert counts.get(batch) == BATCH, f"accepted batch {batch} has {counts.get(batch, 0)} of {BATCH}"
        elif status > 0:
            assert batch not in counts, f"batch {batch} answered {status} yet {counts[batch]} of it was published"
        else:  # no answer, or 503 saying the commit's outcome is unknown
            assert counts.get(batch, 0) in (0, BATCH), f"batch {batch} ({status}) is half published"
