"""Operator changes of limits and API keys go to the operator log (real Kafka) first, then Redis (real). These tests
fail the Redis write half-way, or the look at Redis after it, and check what the operator is told and what the log
keeps: a change Redis refused leaves nothing in the log (but a revocation Redis cannot be asked about after it),
and a change made is answered as made."""

import orjson
import pytest

from streams.errors import StoreUnavailable
from streams.gate.limits import LimitChange, LimitStore
from streams.ingest.api_keys import ApiKeys, key_id
from streams.names import RedisKeys
from streams.state.log import OperatorLog
from tests.harness import HookedLog


def logged(stack, topic, key):
    return OperatorLog(stack.bootstrap, topic).snapshot().get(key)


def _breaking(redis_client, key):
    def break_the_hash(*_):
        redis_client.delete(key)
        redis_client.set(key, "not a hash")
    return break_the_hash


def test_a_limit_change_redis_refuses_is_taken_back_out_of_the_operator_log(stack, redis_client, namespace,
                                                                            oplog_topic):
    """Given resend's limits at 10/10,
    When a change to 1000/1000 is written to the operator log and its Redis write then fails,
    Then the change is refused (the store is unavailable) and the log holds 10/10 again (before: it kept 1000/1000,
    which a Redis rebuild after the failure put in force although the operator was told it failed)."""
    LimitStore(redis_client, namespace, OperatorLog(stack.bootstrap, oplog_topic)).set_provider("resend", 10, 10)
    store = LimitStore(redis_client, namespace, HookedLog(stack.bootstrap, oplog_topic,
                                                          _breaking(redis_client, RedisKeys(namespace).limits("resend"))))
    with pytest.raises(StoreUnavailable, match="cannot write the limits"):
        store.set_provider("resend", 1000, 1000)
    assert logged(stack, oplog_topic, "limits/resend") == {"global_burst": 10, "global_rate": 10, "reserve": 0}


def test_a_limit_change_whose_look_at_redis_after_it_fails_is_answered_as_made(stack, redis_client, namespace,
                                                                              oplog_topic, monkeypatch):
    """Given resend's limits at 10/10, and Redis unreadable right after a change to 20/20 is written,
    When the change is applied,
    Then it is answered as made, with the new limits (before: the Redis error escaped: the API answered 503
    "nothing changed", the CLI exited 1, and no audit record was written for limits in force)."""
    store = LimitStore(redis_client, namespace, OperatorLog(stack.bootstrap, oplog_topic))
    store.set_provider("resend", 10, 10)
    write = store._write

    def write_then_redis_goes(*args):
        written = write(*args)
        monkeypatch.setattr(store, "show", lambda provider: (_ for _ in ()).throw(StoreUnavailable("down (test)")))
        return written

    monkeypatch.setattr(store, "_write", write_then_redis_goes)
    _, after, _ = store.apply("resend", LimitChange(global_rate=20, global_burst=20))
    assert (after["global_rate"], after["global_burst"]) == (20, 20)
    assert redis_client.hget(RedisKeys(namespace).limits("resend"), "global_rate") == b"20"
    assert logged(stack, oplog_topic, "limits/resend")["global_rate"] == 20


def test_a_key_revocation_redis_refuses_is_taken_back_and_one_whose_look_back_fails_is_made(
        stack, redis_client, namespace, oplog_topic, monkeypatch):
    """Given a tenant's API key,
    When a revocation's Redis write fails after its log write (and Redis cannot be read after it either), and then
    a revocation whose look at Redis after the write fails,
    Then the first is refused (503: retry) and the log keeps the revocation: while Redis cannot say what it holds,
    a revocation is never taken back out of the log (a rebuild then applies what the operator asked for, and never
    brings back valid a key Redis may hold revoked); and the second is answered as made, the key revoked in Redis
    and in the log (before: 503 and no audit record for a revocation in force)."""
    keys = RedisKeys(namespace)
    token = ApiKeys(redis_client, namespace, OperatorLog(stack.bootstrap, oplog_topic)).create("tenant", "acme")
    digest = next(d.decode() for d in redis_client.hkeys(keys.api_keys) if d.decode()[:12] == key_id(token))
    stored = redis_client.hget(keys.api_keys, digest)

    broken = ApiKeys(redis_client, namespace, HookedLog(stack.bootstrap, oplog_topic,
                                                        _breaking(redis_client, keys.api_keys)))
    with pytest.raises(StoreUnavailable):
        broken.revoke(key_id(token))
    assert logged(stack, oplog_topic, f"apikey/{digest}")["revoked_at_ms"]
    redis_client.delete(keys.api_keys)
    redis_client.hset(keys.api_keys, digest, stored)

    store = ApiKeys(redis_client, namespace, OperatorLog(stack.bootstrap, oplog_topic))
    monkeypatch.setattr(store, "_raw", lambda digest: (_ for _ in ()).throw(StoreUnavailable("down (test)")))
    revoked = store.revoke(key_id(token))
    assert revoked is not None and revoked.revoked_at_ms
    assert orjson.loads(redis_client.hget(keys.api_keys, digest))["revoked_at_ms"] == revoked.revoked_at_ms
    assert logged(stack, oplog_topic, f"apikey/{digest}")["revoked_at_ms"] == revoked.revoked_at_ms
