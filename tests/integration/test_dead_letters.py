"""Events that cannot be dispatched go to notif.dlq with a reason; the partition keeps moving."""

import subprocess
import sys
import uuid

import pytest
from confluent_kafka import Producer

from streams.errors import BrokerUnavailable, ReplayRefused
from streams.kafka_client import partition_for
from streams.retry.dlq import find, latest
from streams.send import build_send, encode, validate_request
from streams.topology.admin import TopicAdmin
from streams.topology.spec import TopicSpec
from tests.harness import committed_lag, email_request, read_topic, wait_until


def test_lane_violation_and_malformed_events_are_dead_lettered_and_the_partition_continues(
        stack, names, channel_topics, limits, processes, mock_provider):
    """Given one transactional email partition holding a marketing send, invalid JSON, a schema version 2 event, an SMS
    send, and behind them a valid transactional email,
    When a transactional email worker runs,
    Then only the valid email is delivered, the partition is committed past every bad event, and the four bad events
    are in notif.dlq with reasons lane_violation, malformed, unknown_version and channel_mismatch; the lane violation
    keeps its send id, origin topic, offset, group and byte-identical payload, and the unknown version names schema
    version 2 and its send id."""
    channel_topics("email", lane_partitions=1)
    limits.set_provider("resend", 100, 100)
    limits.set_tenant("resend", "*", 100, 100)
    topic = names.lane("email", "transactional")
    marketing = build_send(validate_request(email_request("marketing")), "acme")
    after = build_send(validate_request(email_request()), "acme")

    # Given, on one partition: a marketing send (never allowed here), garbage, a future schema
    # version, an SMS send, and then a valid transactional send
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    producer.produce(topic, key=b"acme", value=encode(marketing))
    producer.produce(topic, key=b"acme", value=b"{not json")
    producer.produce(topic, key=b"acme", value=b'{"v": 2, "send_id": "future-1"}')
    sms = build_send(validate_request({**email_request(), "channel": "sms",
                                       "payload": {"to": "+14155550123", "body": "x"}}), "acme")
    producer.produce(topic, key=b"acme", value=encode(sms))
    producer.produce(topic, key=b"acme", value=encode(after))
    producer.flush(10)

    processes.worker("email", "transactional")

    # Then the valid send behind them is delivered and the partition is fully committed
    wait_until(lambda: committed_lag(stack.bootstrap, names.group("email", "transactional"), topic) == 0,
               30, "the partition to be committed past every bad event")
    stats = mock_provider.stats(deliveries=True)
    assert list(stats["deliveries"]) == [after.send_id]

    # And each bad event is in the DLQ with its reason, origin and (where known) send id
    dead = read_topic(stack.bootstrap, names.dlq, expect=4)
    by_reason = {dict(m.headers())["reason"].decode(): m for m in dead}
    assert set(by_reason) == {"lane_violation", "malformed", "unknown_version", "channel_mismatch"}
    violation = by_reason["lane_violation"]
    h = dict(violation.headers())
    assert violation.key() == marketing.send_id.encode() and h["send_id"] == marketing.send_id.encode()
    assert h["origin_topic"] == topic.encode() and h["origin_offset"] == b"0"
    assert h["group"] == names.group("email", "transactional").encode()
    assert violation.value() == encode(marketing)  # the payload travels byte-identical
    assert dict(by_reason["unknown_version"].headers())["send_id"] == b"future-1"
    assert b"schema version 2" in dict(by_reason["unknown_version"].headers())["detail"]


def test_listing_dead_letters_keeps_only_the_newest_asked_for_and_never_passes_a_partial_list_off_as_whole(
        stack, names, channel_topics, dispatch_env):
    """Given 30 dead letters of two reasons spread over the DLQ's partitions, each with a 10 KB payload,
    When operators list the newest 4 `retries_exhausted` ones (`streams dlq list`, GET /v1/admin/dlq), and then list
    with no time at all to read the topic,
    Then they get those 4, oldest first, without payloads (the listing holds `limit` letters, not the whole DLQ's
    payloads: a week of a blast's, up to 1 MiB each, in the API process every tenant's sends go through), the
    total counts all 30; and the listing that could not read every partition to its end is an error
    (BrokerUnavailable: 503), not a shorter list taken for the whole."""
    channel_topics("email")
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    for i in range(30):
        reason = "retries_exhausted" if i % 2 else "permanent_error"
        producer.produce(names.dlq, key=f"s-{i}".encode(), value=b"x" * 10_000, timestamp=1_700_000_000_000 + i,
                         headers=[("send_id", f"s-{i}".encode()), ("reason", reason.encode())])
    producer.flush(10)

    listing = latest(stack.bootstrap, names.dlq, 4, "retries_exhausted")
    assert listing.total == 30
    assert [r.send_id for r in listing.latest] == ["s-23", "s-25", "s-27", "s-29"]
    assert all(r.value is None for r in listing.latest)
    cli = subprocess.run([sys.executable, "-m", "streams.cli", "dlq", "list", "--reason", "retries_exhausted",
                          "--limit", "4"], env=dispatch_env, capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert [line.split()[0] for line in cli.stdout.splitlines()] == ["s-23", "s-25", "s-27", "s-29", "4"]
    assert cli.stdout.splitlines()[-1] == "4 of 30 dead letters"
    with pytest.raises(BrokerUnavailable, match="not read to their end"):
        latest(stack.bootstrap, names.dlq, 4, timeout_s=0)


def test_listing_the_newest_dead_letters_reads_only_each_partitions_last_ones(
        stack, names, channel_topics, monkeypatch):
    """Given 60 dead letters spread over the DLQ's partitions,
    When an operator lists the newest 4 of any reason (`streams dlq list`, GET /v1/admin/dlq),
    Then they get the 4 newest and the total of 60, having read at most 4 of each partition (before: every record
    from the oldest, payloads included, so a DLQ holding a week of an incident's letters took longer than the
    listing's 30 s and the listing failed as a broker outage, when operators needed it most)."""
    from streams.retry import dlq

    channel_topics("email")
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    for i in range(60):
        producer.produce(names.dlq, key=f"s-{i}".encode(), value=b"x" * 1_000, timestamp=1_700_000_000_000 + i,
                         headers=[("send_id", f"s-{i}".encode()), ("reason", b"permanent_error")])
    producer.flush(10)
    read = []
    real_record = dlq._record
    monkeypatch.setattr(dlq, "_record", lambda m, payload=True: read.append(m.offset()) or real_record(m, payload))

    listing = latest(stack.bootstrap, names.dlq, 4)
    assert [r.send_id for r in listing.latest] == ["s-56", "s-57", "s-58", "s-59"]
    assert listing.total == 60
    assert len(read) <= 4 * 6  # the DLQ's 6 partitions, 4 read of each at most


def test_a_dead_letter_written_before_the_dlq_gained_partitions_is_still_found(stack, names, create_topics):
    """Given a dead letter written while the DLQ had one partition, and the DLQ then grown to four, with the send's
    status gone (so no recorded position),
    When an operator looks its send up (`streams dlq show`, a replay),
    Then the letter is found in the partition it was written to (the current count maps its key elsewhere), and a
    send never dead-lettered is still said not to be in the DLQ."""
    create_topics({names.dlq: 1})
    send_id = next(s for s in (str(uuid.uuid4()) for _ in range(100)) if partition_for(s.encode(), 4) != 0)
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    producer.produce(names.dlq, key=send_id.encode(), value=b'{"v": 1}', headers={"reason": "retries_exhausted"})
    assert producer.flush(10) == 0

    TopicAdmin(stack.bootstrap).ensure({names.dlq: TopicSpec(names.dlq, 4, 1, {})})

    found = find(stack.bootstrap, names.dlq, send_id)
    assert (found.partition, found.offset, found.send_id, found.reason) == (0, 0, send_id, "retries_exhausted")
    with pytest.raises(ReplayRefused, match="is not in the DLQ"):
        find(stack.bootstrap, names.dlq, str(uuid.uuid4()))
