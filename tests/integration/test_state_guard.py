"""The state guard after a Redis data loss, on a real Redis and operator log: the operator state comes back from
the log once, only where Redis lacks it, so changes made after it came back (an endpoint deleted, a key revoked)
stay made whatever another role's guard read of the log before them."""

import pytest
import redis
from prometheus_client import REGISTRY

from streams.errors import StackError, StateLost, StoreUnavailable
from streams.ingest.api_keys import ApiKeys
from streams.ingest.status import StatusStore
from streams.names import HASH_SLOTS, RedisKeys
from streams.send import new_send_id
from streams.state.guard import StateGuard, restore
from streams.state.log import OperatorLog
from streams.webhooks.endpoints import EndpointStore
from streams.webhooks.lookups import system_resolver
from streams.webhooks.ssrf import UrlPolicy


class LogAsItWas:
    """The operator log as a guard read it just before the changes of the test (its look was under way)."""

    def __init__(self, snapshot: dict):
        self._snapshot = snapshot

    def snapshot(self) -> dict:
        return self._snapshot


def test_an_endpoint_deleted_and_a_key_revoked_after_the_restore_stay_so_through_other_roles_looks(
        stack, oplog_topic, namespace, redis_client):
    """Given a deployment with tenant acme's endpoint and API key, whose Redis then loses its data,
    When the API's guard notices and restores the operator state, acme deletes the endpoint and an operator revokes
    the key, and then a worker's guard looks with the log as it read it before those two changes,
    Then the endpoint stays deleted and the key revoked (each hash slot is restored once after it lost its data);
    and a restore from that older log never writes over what Redis holds. Before, every guard restored at every
    look while dispatch held, writing its snapshot over Redis: the endpoint came back (listed, counted against the
    tenant's limit) and the revoked key worked again."""
    keys, oplog = RedisKeys(namespace), OperatorLog(stack.bootstrap, oplog_topic)
    api_guard = StateGuard(redis_client, keys, oplog, "api")
    assert api_guard.check()  # a new deployment: it writes the epoch
    endpoints = EndpointStore(redis_client, namespace, oplog, UrlPolicy(require_https=False,
                                                                        allow=frozenset({"127.0.0.1"})),
                              system_resolver)
    endpoint, _ = endpoints.create("acme", "http://127.0.0.1:9/hook", ["*"])
    api_keys = ApiKeys(redis_client, namespace, oplog)
    token = api_keys.create("tenant", "acme")
    key_id = api_keys.resolve(token).key_id

    lost = list(redis_client.scan_iter(f"{namespace}*"))
    assert redis_client.delete(*lost) == len(lost)
    assert not api_guard.check(force=True)  # the loss: dispatch holds, the operator state is back
    assert endpoints.get("acme", endpoint.id) is not None and api_keys.resolve(token) is not None
    before = oplog.snapshot()

    assert endpoints.delete("acme", endpoint.id)
    assert api_keys.revoke(key_id).revoked_at_ms
    worker_guard = StateGuard(redis_client, keys, LogAsItWas(before), "worker")
    assert not worker_guard.check(force=True)  # it holds too

    assert endpoints.get("acme", endpoint.id) is None and endpoints.all("acme") == []
    assert api_keys.resolve(token) is None
    redis_client.delete(*(keys.restored_marker(slot) for slot in range(HASH_SLOTS)))  # as if never restored
    restore(redis_client, keys, before)
    assert api_keys.resolve(token) is None  # what Redis holds is never written over


class StallingLog:
    """The operator log, its reads timing out while `stalled` (as while `streams state recover` loads the broker)."""

    def __init__(self, oplog: OperatorLog):
        self.oplog, self.stalled = oplog, False

    def snapshot(self) -> dict:
        if self.stalled:
            raise StackError("the operator log did not answer within 10 s")
        return self.oplog.snapshot()

    def put(self, key: str, value: dict | None) -> None:
        self.oplog.put(key, value)


class PipelinesRefused:
    """A Redis client whose reads go through and whose pipelines (the restore's writes) are refused."""

    def __init__(self, client):
        self.client = client

    def __getattr__(self, name):
        return getattr(self.client, name)

    def pipeline(self, *args, **kwargs):
        raise redis.ConnectionError("Redis refused the connection")


def test_a_guard_that_cannot_finish_its_check_never_says_redis_holds_its_data(
        stack, oplog_topic, namespace, redis_client):
    """Given an API's guard that has checked Redis (intact), and Redis then losing its data,
    When the guard's next check cannot read the operator log (it stalls), and it is asked again at once,
    Then it says it cannot tell, both times, and a replay is not claimed (before: the failed check's answer was
    kept for 5 s as "intact", and a replay claimed meanwhile, while recovery rebuilt statuses ahead of replay
    marks, replayed a send twice); and a guard that sees the loss but whose restore of the operator state fails
    reports the loss all the same (before: `dispatch_redis_state_lost` stayed 0 and the alert never fired while
    the restore kept failing)."""
    keys = RedisKeys(namespace)
    log = StallingLog(OperatorLog(stack.bootstrap, oplog_topic))
    guard = StateGuard(redis_client, keys, log, "api")
    assert guard.check()
    replays = StatusStore(redis_client, namespace, holds_data=guard.check)

    redis_client.delete(keys.epoch)  # what the guard reads of a loss
    log.stalled = True
    with pytest.raises(StackError):
        guard.check(force=True)
    with pytest.raises(StackError):
        guard.check()
    with pytest.raises(StoreUnavailable, match="no replay is claimed"):
        replays.claim_replay(new_send_id())

    log.stalled = False
    worker_guard = StateGuard(PipelinesRefused(redis_client), keys, log, "worker")
    with pytest.raises(StoreUnavailable):
        worker_guard.check(force=True)
    assert worker_guard.lost and REGISTRY.get_sample_value("dispatch_redis_state_lost") == 1
    assert not guard.check(force=True)  # the log readable again: the loss is seen
    with pytest.raises(StateLost):
        replays.claim_replay(new_send_id())


def test_a_replay_is_not_claimed_once_redis_lost_its_data_whatever_the_guard_said_before(
        stack, oplog_topic, namespace, redis_client):
    """Given an API's guard that found Redis intact a moment ago (it looks at most every 5 s),
    When Redis loses its data before its next look and a replay is asked,
    Then no replay is claimed, saying why: the claim itself needs the epoch, which `streams state recover` writes
    back last (before: claimed on the guard's earlier answer; a dead letter whose status recovery had rebuilt ahead
    of its replay mark was replayed a second time)."""
    keys = RedisKeys(namespace)
    guard = StateGuard(redis_client, keys, OperatorLog(stack.bootstrap, oplog_topic), "api")
    assert guard.check()
    rechecks = []
    replays = StatusStore(redis_client, namespace, holds_data=lambda: True,  # the guard's answer from before
                          on_lost=lambda: rechecks.append(1))
    assert replays.claim_replay(new_send_id())

    redis_client.delete(keys.epoch)
    send_id = new_send_id()
    with pytest.raises(StateLost, match="no replay is claimed"):
        replays.claim_replay(send_id)
    assert redis_client.hget(keys.send_status(send_id), "replayed_as") is None
    assert rechecks == [1]  # the guard is told to look again at once (a slot it had not seen lost)
