"""Poison records never crash a worker or stall its partition: each is dead-lettered with a reason (or held
and retried), and the work behind it goes on."""

import signal
from dataclasses import replace

import orjson
from confluent_kafka import Producer

from streams.retry.dlq import read_all
from streams.send import build_send, encode, validate_request
from streams.topology.admin import TopicAdmin
from streams.topology.spec import channel_specs, load_definitions
from tests.harness import committed_lag, email_request, report_outcome, wait_until

SMALL = "60000"  # max.message.bytes of the retry tier and the DLQ in this test


def test_records_too_large_for_their_retry_or_dlq_copy_and_bad_headers_are_dead_lettered(
        fault_stack, fault_runtime, fault_processes, mock_provider, names, namespace):
    """Given a transactional lane whose 10 s retry tier and DLQ accept at most 60 kB, a provider failing with
    500, an email of 100 kB, an event with the header `attempt: 2x`, an unreadable event with 100 kB of
    headers, and a valid email behind them,
    When the worker attempts them,
    Then the big email's retry copy is refused, so is its dead letter, and it is dead-lettered without its
    payload (reason too_large, headers naming where the original is); the bad header is dead-lettered as
    malformed; the unreadable one is dead-lettered with dispatch's own headers only; the worker stays alive,
    the valid email is delivered once the provider recovers, and the lane
    is committed to its end."""
    specs = channel_specs(load_definitions(namespace=namespace), namespace, ("email",))
    small = {names.retry("email", "transactional", "10s"), names.dlq}
    TopicAdmin(fault_stack.bootstrap).ensure({n: replace(s, config={**s.config, "max.message.bytes": SMALL})
                                              if n in small else s for n, s in specs.items()})
    limits = fault_runtime.limit_store()
    limits.set_provider("resend", 100, 100)
    limits.set_tenant("resend", "*", 100, 100)
    mock_provider.reset(fault_5xx_ratio=1.0)
    worker = fault_processes.worker("email", "transactional")
    client = fault_runtime.send_client()
    big = client.publish("acme", email_request(html="<p>" + "x" * 100_000 + "</p>"))
    raw = encode(build_send(validate_request(email_request()), "acme"))
    producer = Producer({"bootstrap.servers": fault_stack.bootstrap})
    producer.produce(names.lane("email", "transactional"), key=b"acme", value=raw, headers=[("attempt", b"2x")])
    # Unreadable, and carrying headers the DLQ cannot take even without the payload.
    producer.produce(names.lane("email", "transactional"), key=b"acme", value=b'{"v": 1, "send_id": "junk-1"}',
                     headers=[("junk", b"x" * 100_000), ("tenant", None)])  # and a header without a value
    producer.flush(10)

    letters = wait_until(lambda: {r.send_id: r for r in d} if len(d := read_all(fault_stack.bootstrap, names.dlq,
                                                                                timeout_s=3)) >= 3 else None,
                         60, "the three poison records in the DLQ", interval=1.0)
    big_letter, malformed, junk = letters[big], letters[build_send_id(raw)], letters["junk-1"]
    assert big_letter.reason == "too_large" and big_letter.value is None
    assert big_letter.headers["payload_omitted"] == "too_large"
    assert big_letter.headers["reason_detail"] == "retry_copy_too_large"
    assert big_letter.headers["origin_topic"] == names.lane("email", "transactional")
    assert malformed.reason == "malformed" and malformed.value == raw and "attempt" in malformed.headers["detail"]
    # Refused with its payload and again without it: kept with dispatch's own headers only (before, the
    # worker crashed on it, and again on every restart).
    assert junk.reason == "too_large" and junk.value is None and junk.headers["headers_omitted"] == "too_large"
    assert junk.headers["reason_detail"] == "malformed" and "junk" not in junk.headers

    mock_provider.configure(fault_5xx_ratio=0.0)
    fine = client.publish("acme", email_request())
    wait_until(lambda: fine in mock_provider.stats(deliveries=True)["deliveries"], 30, "the valid email")
    wait_until(lambda: committed_lag(fault_stack.bootstrap, names.group("email", "transactional"),
                                     names.lane("email", "transactional")) == 0, 30, "the lane to be committed")
    assert worker.poll() is None


def build_send_id(raw: bytes) -> str:
    return orjson.loads(raw)["send_id"]


def test_a_stored_request_larger_than_a_lowered_burst_is_still_recovered(
        fault_stack, fault_runtime, fault_topics, fault_processes, mock_provider, names):
    """Given a batch of 100 accepted by the provider whose answer never reached the worker (killed),
    When an operator lowers the tenant's burst to 10 and a new worker finds the stored request,
    Then the request is re-sent as it was (same body, same key: it cannot be split) and charged a full burst,
    instead of failing forever or crashing, and every send is delivered once."""
    fault_topics("email", lane_partitions=1)
    limits = fault_runtime.limit_store()
    limits.set_provider("resend", 100, 100)
    limits.set_tenant("resend", "*", 1000, 100)
    mock_provider.reset(rate=100)
    fault_processes.start("lag-monitor", "lag-monitor", ready="lag monitor publishing")
    mock_provider.configure(hold_answers=True)
    first = fault_processes.worker("email", "marketing")
    ids = fault_runtime.send_client().publish_batch("blaster", [email_request("marketing")] * 100)
    wait_until(lambda: mock_provider.stats()["held"] >= 1, 30, "the provider to hold the accepted batch")
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    mock_provider.configure(hold_answers=False)
    limits.set_tenant("resend", "*", 10, 10)

    second = fault_processes.worker("email", "marketing")
    wait_until(lambda: mock_provider.stats()["idempotent_replays"] >= 1, 60, "the stored request to be re-sent")
    wait_until(lambda: committed_lag(fault_stack.bootstrap, names.group("email", "marketing"),
                                     names.lane("email", "marketing")) == 0, 30, "the lane to be committed")
    stats = mock_provider.stats(deliveries=True)
    report_outcome("stored request over a lowered burst", ids, stats, fault_processes.procs)
    assert set(ids) <= set(stats["deliveries"]) and stats["duplicate_deliveries"] == 0
    assert second.poll() is None


def test_events_no_check_foresaw_are_dead_lettered_or_delivered_never_a_crash_loop(
        fault_stack, fault_runtime, fault_topics, fault_processes, mock_provider, names):
    """Given events written to the transactional email lane directly (past ingest's validation):
    a category that is a JSON array, an `attempt` header with no value, a `provider` header and a
    `providers_tried` header that are not UTF-8, and an email whose `tags` is null,
    When a worker process reads them,
    Then the first two are dead-lettered as malformed with a detail saying why, the other three are
    delivered once (an unreadable provider name means the channel's first provider; null tags mean
    none), the worker stays alive, and the lane is committed to its end."""
    fault_topics("email", lane_partitions=1)
    limits = fault_runtime.limit_store()
    limits.set_provider("resend", 100, 100)
    limits.set_tenant("resend", "*", 100, 100)
    mock_provider.reset()
    worker = fault_processes.worker("email", "transactional")
    lane = names.lane("email", "transactional")

    def event(**payload) -> tuple[str, bytes]:
        send = build_send(validate_request(email_request(**payload)), "acme")
        return send.send_id, encode(send)

    producer = Producer({"bootstrap.servers": fault_stack.bootstrap})
    producer.produce(lane, key=b"acme", value=b'{"v": 1, "category": [1], "lane": "transactional"}')
    no_attempt, raw = event()
    producer.produce(lane, key=b"acme", value=raw, headers=[("attempt", None)])
    delivered = []
    for headers, payload in (([("provider", b"\xff\xfe")], {}), ([("providers_tried", b"\xffresend")], {}),
                             ([], {"tags": None})):
        send_id, raw = event(**payload)
        producer.produce(lane, key=b"acme", value=raw, headers=headers)
        delivered.append(send_id)
    assert producer.flush(10) == 0

    dead = wait_until(lambda: d if len(d := read_all(fault_stack.bootstrap, names.dlq, timeout_s=3)) >= 2 else None,
                      60, "both unreadable events in the DLQ", interval=1.0)
    assert [r.headers["reason"] for r in dead] == ["malformed", "malformed"]
    # The two dead letters may sit on different DLQ partitions, so they are read back in any order.
    [attempt_less] = [r for r in dead if r.send_id == no_attempt]
    [unreadable] = [r for r in dead if r.send_id != no_attempt]
    assert "category: Input should be" in unreadable.headers["detail"]
    assert "attempt" in attempt_less.headers["detail"]
    wait_until(lambda: set(delivered) <= set(mock_provider.stats(deliveries=True)["deliveries"]), 30,
               "the three readable emails")
    wait_until(lambda: committed_lag(fault_stack.bootstrap, names.group("email", "transactional"), lane) == 0, 30,
               "the lane to be committed")
    assert mock_provider.stats()["duplicate_deliveries"] == 0
    assert worker.poll() is None
