"""Sender domains set at run time are operator state: the operator log (real Kafka) first, then Redis (real),
and a Redis rebuild restores them from the log. These tests fail a write half-way, or interleave two
operators' changes, and check that the log never keeps what Redis does not hold."""

import orjson
import pytest
import redis

from streams.errors import StoreUnavailable
from streams.ingest.sender_store import SenderDomainStore
from streams.names import RedisKeys
from streams.state.log import OperatorLog
from tests.harness import HookedLog


def logged(stack, topic, tenant):
    return OperatorLog(stack.bootstrap, topic).snapshot().get(f"senders/{tenant}")


def test_a_change_redis_refuses_is_taken_back_out_of_the_operator_log(stack, redis_client, namespace, oplog_topic):
    """Given acme's sender domains set to acme.test,
    When a change to other.test is written to the operator log and its Redis write then fails,
    Then the change is refused (the store is unavailable) and the log holds acme.test again (before, it kept
    other.test, which a Redis rebuild would have put in force although the operator was told it failed)."""
    key = RedisKeys(namespace).sender_domains
    SenderDomainStore(redis_client, namespace, OperatorLog(stack.bootstrap, oplog_topic)).set("acme", ["acme.test"])

    def break_the_hash(*_):
        redis_client.delete(key)
        redis_client.set(key, "not a hash")

    store = SenderDomainStore(redis_client, namespace, HookedLog(stack.bootstrap, oplog_topic, break_the_hash))
    with pytest.raises(StoreUnavailable, match="saving sender domains"):
        store.set("acme", ["other.test"])
    assert logged(stack, oplog_topic, "acme") == {"domains": ["acme.test"]}


def test_removing_clears_an_entry_only_the_operator_log_holds(stack, redis_client, namespace, oplog_topic):
    """Given an entry for acme in the operator log that Redis does not hold (a change whose Redis write and
    whose taking back both failed),
    When the operator removes acme's sender domains,
    Then the answer is that there were none (nothing in force changed) and the log no longer holds the entry
    (before, the removal stopped at Redis's answer: the entry stayed in the log for a rebuild to apply)."""
    oplog = OperatorLog(stack.bootstrap, oplog_topic)
    oplog.put("senders/acme", {"domains": ["stale.test"]})
    assert SenderDomainStore(redis_client, namespace, oplog).remove("acme") is False
    assert logged(stack, oplog_topic, "acme") is None


@pytest.mark.parametrize("meanwhile", ["set", "remove"])
def test_two_operators_changing_one_tenant_leave_the_log_ending_with_what_redis_holds(
        stack, redis_client, namespace, oplog_topic, meanwhile):
    """Given acme's sender domains set to old.test, and operator A setting them to a.test, whose log record is
    written,
    When operator B sets acme to b.test (or removes acme's entry) completely before A's Redis write,
    Then Redis holds a.test (A wrote last) and so does the operator log's last word on acme (before, the log
    ended with B's record while Redis held A's: a Redis rebuild silently switched acme to B's)."""
    other = SenderDomainStore(redis_client, namespace, OperatorLog(stack.bootstrap, oplog_topic))
    other.set("acme", ["old.test"])

    def b_meanwhile(*_):
        other.set("acme", ["b.test"]) if meanwhile == "set" else other.remove("acme")

    first = SenderDomainStore(redis_client, namespace, HookedLog(stack.bootstrap, oplog_topic, b_meanwhile))
    assert first.set("acme", ["a.test"]) == ["a.test"]
    assert orjson.loads(redis_client.hget(RedisKeys(namespace).sender_domains, "acme")) == ["a.test"]
    assert logged(stack, oplog_topic, "acme") == {"domains": ["a.test"]}


def test_a_change_whose_look_back_at_redis_fails_is_still_a_change_made(stack, redis_client, namespace, oplog_topic,
                                                                        monkeypatch):
    """Given a removal written to the operator log and to Redis,
    When reading Redis again after it (to log what Redis holds) fails,
    Then the removal is answered as made (before, the Redis error escaped: the API answered 503, recorded no
    audit entry, and the same DELETE again found nothing: the removal was never audited)."""
    store = SenderDomainStore(redis_client, namespace, OperatorLog(stack.bootstrap, oplog_topic))
    store.set("acme", ["acme.test"])
    looks = [store._logged_form]  # the look before the change answers; the one after it fails

    def unreachable_after_the_change(tenant):
        if looks:
            return looks.pop()(tenant)
        raise StoreUnavailable("reading sender domains: Redis unavailable (test)")

    monkeypatch.setattr(store, "_logged_form", unreachable_after_the_change)
    assert store.remove("acme") is True
    assert redis_client.hget(RedisKeys(namespace).sender_domains, "acme") is None
    assert logged(stack, oplog_topic, "acme") is None



def test_a_change_redis_applied_but_whose_answer_was_lost_stays_in_the_operator_log(stack, redis_client, namespace,
                                                                                      oplog_topic):
    """Given acme's sender domains set to acme.test,
    When a change to other.test reaches Redis but the connection drops before Redis's answer,
    Then the change is answered as failed (the store is unavailable) and the log holds what Redis holds,
    other.test (before, the log was given back acme.test, the value read before the change: a Redis rebuild from
    the log then silently reverted a change Redis had in force)."""
    SenderDomainStore(redis_client, namespace, OperatorLog(stack.bootstrap, oplog_topic)).set("acme", ["acme.test"])

    class AnswerLost:
        def __getattr__(self, name):
            return getattr(redis_client, name)

        def hset(self, *args):
            redis_client.hset(*args)
            raise redis.ConnectionError("connection reset by peer (test)")

    store = SenderDomainStore(AnswerLost(), namespace, OperatorLog(stack.bootstrap, oplog_topic))
    with pytest.raises(StoreUnavailable, match="saving sender domains"):
        store.set("acme", ["other.test"])
    assert orjson.loads(redis_client.hget(RedisKeys(namespace).sender_domains, "acme")) == ["other.test"]
    assert logged(stack, oplog_topic, "acme") == {"domains": ["other.test"]}
