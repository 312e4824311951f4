"""`streams state recover` on a real broker and Redis: it reads notif.outcomes to its end and rebuilds the
delivered marks, whatever else the topic holds."""

import time
import uuid

import orjson
from confluent_kafka import Producer

from streams.ingest.status import StatusStore
from streams.names import RedisKeys
from streams.state.guard import log_epoch
from streams.state.log import OperatorLog
from streams.state.recover import recover


def _delivered(send_id: str, now_ms: int) -> dict:
    return {"send_id": send_id, "tenant_id": "acme", "channel": "email", "lane": "transactional",
            "status": "delivered", "attempts": 1, "provider": "resend", "provider_message_id": "m1", "reason": "",
            "created_at_ms": now_ms - 1000, "completed_at_ms": now_ms}


def test_recover_finishes_when_a_transaction_marker_ends_the_outcomes_partition(
        stack, channel_topics, oplog_topic, names, namespace, redis_client):
    """Given notif.outcomes whose one partition ends with a transaction of two outcome records (as ingest writes
    a request's skipped deliveries), so its last offset is the commit marker no consumer is ever given,
    When `streams state recover` runs,
    Then it finishes, rebuilds both sends' delivered marks and statuses, and writes the epoch back."""
    channel_topics("email")
    now_ms = int(time.time() * 1000)
    producer = Producer({"bootstrap.servers": stack.bootstrap, "transactional.id": f"test-{uuid.uuid4().hex}"})
    producer.init_transactions(10)
    producer.begin_transaction()
    for send_id in ("s-1", "s-2"):
        producer.produce(names.outcomes, orjson.dumps(_delivered(send_id, now_ms)), key=b"k", partition=0)
    producer.commit_transaction(10)
    keys = RedisKeys(namespace)
    oplog = OperatorLog(stack.bootstrap, oplog_topic)

    result = recover(stack.bootstrap, redis_client, names, keys, oplog)

    assert (result.events, result.delivered_marks, result.skipped) == (2, 2, 0)
    assert [redis_client.get(keys.processed("acme", s)) for s in ("s-1", "s-2")] == [b"delivered", b"delivered"]
    store = StatusStore(redis_client, namespace)
    assert [store.get(s)["status"] for s in ("s-1", "s-2")] == ["delivered", "delivered"]
    assert redis_client.get(keys.epoch).decode() == log_epoch(oplog.snapshot())
