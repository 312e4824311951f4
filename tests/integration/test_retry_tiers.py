"""Retry tiers: each message released at its own due time, never early, whatever is ahead of it."""

import time

from confluent_kafka import Consumer, Producer, TopicPartition

from streams.retry.retrier import Retrier, RetrierConfig
from streams.send import build_send, encode, validate_request
from tests.harness import free_port, group_assigned, metric, read_topic, sms_request, wait_until

SLACK_MS = 2000


def _committed(bootstrap: str, group: str, topic: str, partition: int) -> int:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        return c.committed([TopicPartition(topic, partition)], timeout=10)[0].offset
    finally:
        c.close()


def test_each_message_is_released_at_its_own_due_time(stack, names, channel_topics, processes):
    """Given one retrier for the SMS transactional lane and, on its tiers: two sends due in 3 s and 3.5 s on
    partition 0 of the 10 s tier, one due in 4 s on the 1 m tier, on partition 2 of the 10 s tier a head due in an
    hour with a send due in 1 s behind it, and on the 12 h tier a send whose Retry-After asked for 13 h,
    When their due times pass,
    Then the four due sends are re-published to the lane byte-identical, never early and at most 2 s late, even the
    one behind the far-future head; the two far-future sends stay held (never early), and the tier's committed
    offset on partition 2 stays at the unreleased head while partition 0's moves past its released sends."""
    channel_topics("sms")
    lane = names.lane("sms", "transactional")
    ten_s, one_m, twelve_h = (names.retry("sms", "transactional", t) for t in ("10s", "1m", "12h"))
    port = free_port()
    processes.start("retrier", "retrier", "--channel", "sms", "--lane", "transactional", "--metrics-port", str(port),
                    ready="retrier consuming")
    wait_until(lambda: group_assigned(stack.bootstrap, names.retry_group("sms", "transactional")), 30,
               "the retrier to hold its partitions")  # the due times below count from then
    now = int(time.time() * 1000)
    sends = {}
    producer = Producer({"bootstrap.servers": stack.bootstrap})

    def put(topic: str, partition: int, due_in_ms: int, label: str) -> None:
        send = build_send(validate_request(sms_request()), "acme")
        sends[send.send_id] = (label, now + due_in_ms, encode(send))
        producer.produce(topic, partition=partition, key=b"acme", value=encode(send),
                         headers=[("due_at_ms", str(now + due_in_ms).encode()), ("attempt", b"2"),
                                  ("send_id", send.send_id.encode())])

    put(ten_s, 0, 3000, "p0-first")
    put(ten_s, 0, 3500, "p0-second")
    put(one_m, 1, 4000, "1m-tier")
    put(ten_s, 2, 3_600_000, "p2-far-future-head")
    put(ten_s, 2, 1000, "p2-behind-the-head")
    put(twelve_h, 0, 13 * 3_600_000, "retry-after-13h")
    producer.flush(10)

    copies = read_topic(stack.bootstrap, lane, expect=4, timeout=20)
    seen = {}
    for m in copies:
        h = dict(m.headers())
        label, due_ms, raw = sends[h["send_id"].decode()]
        seen[label] = m.timestamp()[1] - due_ms
        assert m.value() == raw  # byte-identical payload
        assert h["attempt"] == b"2"
    assert set(seen) == {"p0-first", "p0-second", "1m-tier", "p2-behind-the-head"}
    for label, late_ms in seen.items():
        assert 0 <= late_ms <= SLACK_MS, f"{label} re-published {late_ms} ms after its due time"

    # The gauge is refreshed about once a second, and a released copy counts as held until its acknowledgement.
    wait_until(lambda: {t: metric(port, "dispatch_retry_held_messages", tier=t) for t in ("10s", "12h")}
               == {"10s": 1, "12h": 1}, 10, "the held gauges to show the two far-future sends")
    group = names.retry_group("sms", "transactional")
    wait_until(lambda: _committed(stack.bootstrap, group, ten_s, 0) == 2, 10, "partition 0 committed past its sends")
    assert _committed(stack.bootstrap, group, ten_s, 2) in (0, -1001)  # the unreleased head pins partition 2


def test_the_lag_monitor_sees_a_tier_whose_due_messages_are_not_released(stack, names, channel_topics, processes):
    """Given a retry message due in 1 s on the SMS transactional 10 s tier and no retrier running,
    When the lag monitor watches the tiers (every second here),
    Then it reports one message waiting on that tier, going overdue (the RetryTierStuck alert's input), and
    once a retrier starts and releases it, nothing waits and nothing is overdue; the email tiers, whose topics this
    namespace does not have, say for how long they have not been read (RetryTierUnwatched's input) and export no
    overdue figure, while the SMS tier reads 0 there."""
    channel_topics("sms")
    port = free_port()
    processes.start("lag-monitor", "lag-monitor", "--metrics-port", str(port), "--retry-watch-every", "1",
                    ready="lag monitor publishing")
    send = build_send(validate_request(sms_request()), "acme")
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    producer.produce(names.retry("sms", "transactional", "10s"), key=b"acme", value=encode(send),
                     headers=[("due_at_ms", str(int(time.time() * 1000) + 1000).encode()), ("attempt", b"2")])
    producer.flush(10)

    def tier(name):
        return metric(port, name, channel="sms", lane="transactional", tier="10s")

    wait_until(lambda: tier("dispatch_retry_tier_waiting_messages") == 1
               and (tier("dispatch_retry_tier_overdue_seconds") or 0) > 2, 30, "the tier to show an overdue message")
    assert tier("dispatch_retry_tier_unreadable_seconds") == 0
    email_tier = {"channel": "email", "lane": "transactional", "tier": "10s"}
    wait_until(lambda: (metric(port, "dispatch_retry_tier_unreadable_seconds", **email_tier) or 0) >= 1, 30,
               "the email tier, missing, to say for how long it has not been read")
    assert metric(port, "dispatch_retry_tier_overdue_seconds", **email_tier) is None
    processes.retrier("sms", "transactional")
    wait_until(lambda: tier("dispatch_retry_tier_waiting_messages") == 0
               and tier("dispatch_retry_tier_overdue_seconds") == 0, 30, "the tier to be clear")


def test_a_retrier_full_of_messages_due_late_keeps_reading_its_short_tiers(stack, names, channel_topics):
    """Given a retrier bounded to 4 held messages that holds 4 sends due in 10 hours (a tenant's backlog
    parked on the 12 h tier),
    When a send due now arrives on the 10 s tier,
    Then the retrier pauses only the 12 h tier's partition that holds the late ones: it still reads the 10 s
    tier and re-publishes that send to the lane at once (a plain bound would pause every tier for hours)."""
    channel_topics("sms")
    lane = names.lane("sms", "transactional")
    ten_s, twelve_h = (names.retry("sms", "transactional", t) for t in ("10s", "12h"))
    retrier = Retrier(RetrierConfig("sms", "transactional", stack.bootstrap, names, max_held=4))
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    now = int(time.time() * 1000)

    def put(topic: str, due_ms: int) -> str:
        send = build_send(validate_request(sms_request()), "acme")
        producer.produce(topic, partition=0, key=b"acme", value=encode(send),
                         headers=[("due_at_ms", str(due_ms).encode()), ("attempt", b"2"),
                                  ("send_id", send.send_id.encode())])
        producer.flush(10)
        return send.send_id

    for _ in range(4):
        put(twelve_h, now + 10 * 3_600_000)
    near: list[str] = []
    paused: list[set] = []  # what the retrier had paused when the short tier's send was released
    deadline = time.monotonic() + 60
    released = retrier.tracker  # a message leaves it once its copy on the lane is acknowledged

    def until() -> bool:
        if not near and len(retrier.heap) == 4:  # the bound is reached: now the short tier's send
            near.append(put(ten_s, int(time.time() * 1000)))
        done = bool(near) and released.committable().get((ten_s, 0), 0) >= 1
        if done:
            paused.append(set(retrier.paused))
        return done or time.monotonic() > deadline

    retrier.run(until=until)
    assert near, "the retrier never held the four late sends"
    [copy] = read_topic(stack.bootstrap, lane, expect=1, timeout=10)
    assert dict(copy.headers())["send_id"] == near[0].encode()
    assert paused == [{(twelve_h, 0)}]


def test_a_retry_copy_the_lane_refuses_for_its_size_is_dead_lettered_and_the_tier_moves_on(
        stack, names, namespace, processes):
    """Given an email lane that accepts records of at most 60 kB, and on its 10 s tier an email of 70 kB due now
    (written to the tier directly: ingest never makes one) followed by an ordinary email due now,
    When the retrier releases them,
    Then the big one, refused by the lane, is dead-lettered without its payload (reason too_large, naming the
    retry record that still holds it) and its outcome says so (its status can show it, and it can be replayed);
    the email behind it reaches the lane; the tier is committed past both (before, the refused copy was
    produced again and again and the partition never moved on)."""
    from dataclasses import replace

    import orjson

    from streams.retry.dlq import read_all
    from streams.topology.admin import TopicAdmin
    from streams.topology.spec import channel_specs, load_definitions
    from tests.harness import email_request

    lane, ten_s = names.lane("email", "transactional"), names.retry("email", "transactional", "10s")
    specs = channel_specs(load_definitions(namespace=namespace), namespace, ("email",))
    TopicAdmin(stack.bootstrap).ensure({n: replace(s, config={**s.config, "max.message.bytes": "60000"})
                                        if n == lane else s for n, s in specs.items()})
    processes.start("retrier", "retrier", "--channel", "email", "--lane", "transactional", ready="retrier consuming")
    now = str(int(time.time() * 1000)).encode()
    big = build_send(validate_request(email_request(html="<p>" + "x" * 70_000 + "</p>")), "acme")
    ordinary = build_send(validate_request(email_request()), "acme")
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    for send in (big, ordinary):
        producer.produce(ten_s, partition=0, key=b"acme", value=encode(send),
                         headers=[("due_at_ms", now), ("send_id", send.send_id.encode()), ("attempt", b"2")])
    assert producer.flush(10) == 0

    [copy] = read_topic(stack.bootstrap, lane, expect=1, timeout=20)
    assert copy.value() == encode(ordinary)
    [letter] = wait_until(lambda: d or None if (d := read_all(stack.bootstrap, names.dlq, timeout_s=2)) else None,
                          30, "the refused copy's dead letter", interval=0.5)
    assert letter.send_id == big.send_id and letter.value is None and letter.reason == "too_large"
    assert letter.headers["reason_detail"] == "lane_copy_too_large"
    assert letter.headers["attempts"] == "1"  # the copy was for attempt 2: one was made
    assert (letter.headers["origin_topic"], letter.headers["origin_offset"]) == (ten_s, "0")
    [outcome] = [orjson.loads(m.value()) for m in read_topic(stack.bootstrap, names.outcomes, expect=1, timeout=20)]
    assert (outcome["send_id"], outcome["status"], outcome["reason"], outcome["attempts"]) == (
        big.send_id, "dead_lettered", "too_large", 1)
    assert outcome["dlq"]["offset"] == letter.offset and outcome["origin"] == {"topic": ten_s, "partition": 0,
                                                                                  "offset": 0}
    group = names.retry_group("email", "transactional")
    wait_until(lambda: _committed(stack.bootstrap, group, ten_s, 0) == 2, 15, "the tier committed past both")
