"""Operator state that a reader cannot use, written by someone other than this project's own commands: the
audit trail still reads (a bad record among a year of them hides nothing else), Redis is still rebuilt from
the operator log, and an epoch that is not a string is not taken for one."""

import uuid

import orjson
from confluent_kafka import Producer

from streams import metrics
from streams.kafka_client import put_acked
from streams.names import RedisKeys
from streams.state.audit import AuditLog
from streams.state.guard import log_epoch, restore
from streams.state.log import OperatorLog


def test_unreadable_audit_and_operator_records_are_skipped_and_the_rest_used(stack, channel_topics, names,
                                                                             redis_client):
    """Given an audit record as `streams` writes it, then three that are not (not JSON, a JSON array, an entry
    whose time is a string), then another good one; and operator-log entries with a limit field that is an
    object and an epoch that is a number,
    When the audit trail is read and Redis is rebuilt from the operator log,
    Then the audit trail holds the two good entries and counts the three it skipped; the limits are restored
    without the field Redis cannot hold; and the log's epoch reads as none (so a role writes a real one)."""
    channel_topics("email")
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    audit = AuditLog(stack.bootstrap, names.audit)
    skipped_before = metrics.STATE_RECORDS_UNREADABLE.labels(names.audit)._value.get()
    audit.record("cli:test", "limits/resend", None, {"global_rate": 10})
    for value in (b"{not json", b"[1, 2]", orjson.dumps({"at_ms": "yesterday", "who": "x", "what": "y",
                                                          "before": None, "after": None})):
        put_acked(producer, names.audit, b"limits/resend", value, 10, "an audit record")
    audit.record("cli:test", "limits/resend", {"global_rate": 10}, {"global_rate": 20})
    entries = list(audit.read())
    assert [e["after"] for e in entries] == [{"global_rate": 10}, {"global_rate": 20}]
    assert metrics.STATE_RECORDS_UNREADABLE.labels(names.audit)._value.get() - skipped_before == 3

    oplog = OperatorLog(stack.bootstrap, names.operator)
    oplog.put("limits/resend", {"global_rate": 100, "global_burst": 100, "tenant_rate:*": {"nested": 1}})
    oplog.put("epoch", {"epoch": 5})
    snapshot = oplog.snapshot()
    assert log_epoch(snapshot) is None
    keys = RedisKeys(f"unreadable{uuid.uuid4().hex[:8]}:")
    try:
        assert restore(redis_client, keys, snapshot) == 1
        assert redis_client.hgetall(keys.limits("resend")) == {b"global_rate": b"100", b"global_burst": b"100"}
    finally:
        redis_client.delete(keys.limits("resend"))
