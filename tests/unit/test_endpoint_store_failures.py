"""An endpoint change that Redis fails part-way is answered as what happened, and leaves the operator log (which
the workers follow, and from which a lost Redis is rebuilt) saying what Redis holds."""

import orjson
import pytest
import redis

from streams.errors import PublishOutcomeUnknown, StoreUnavailable
from streams.webhooks.endpoints import EndpointStore
from streams.webhooks.model import Endpoint, Secret
from streams.webhooks.ssrf import UrlPolicy

ENDPOINT = Endpoint("ep_1", "acme", "https://hooks.example/x", ("*",), secrets=(Secret("whsec_b2xk"),))


class Redis:
    """One tenant's endpoints hash. `failing`: the commands that fail, each once: "hget" after its first read,
    "hdel", or "save" (the create's script runs, and its answer is lost)."""

    def __init__(self, held: dict[str, bytes] | None = None, failing: tuple[str, ...] = ()):
        self.held = dict(held or {})
        self.failing = set(failing)
        self.reads = 0

    def register_script(self, text):
        def run(keys, args, client=None):
            if "ZADD" in text.upper() and "HSET" not in text.upper():  # the create's reservation
                return 1
            if len(args) == 3:  # compare-and-set of one field
                if self.held.get(args[0]) != args[1]:
                    return 0
                self.held[args[0]] = args[2]
                return 1
            self.held[args[0]] = args[1]  # the create's save
            if "save" in self.failing:
                self.failing.discard("save")
                raise redis.TimeoutError("Timeout reading from socket (test)")
            return 1
        return run

    def hget(self, key, field):
        self.reads += 1
        if "hget" in self.failing and self.reads > 1:
            self.failing.discard("hget")
            raise redis.ConnectionError("Connection reset by peer (test)")
        return self.held.get(field)

    def hdel(self, key, field):
        if "hdel" in self.failing:
            self.failing.discard("hdel")
            raise redis.ConnectionError("Connection refused (test)")
        return int(self.held.pop(field, None) is not None)

    def zrem(self, *args):
        return 1


class Log:
    def __init__(self, unconfirmed: int = 0):
        self.records: list[tuple[str, dict | None]] = []
        self.unconfirmed = unconfirmed  # the first writes the broker leaves unconfirmed (they may be written)

    def put(self, key, value):
        self.records.append((key, value))
        if self.unconfirmed:
            self.unconfirmed -= 1
            raise PublishOutcomeUnknown("the operator log did not acknowledge (test)")

    def last(self, key):
        return [value for k, value in self.records if k == key][-1]


def _store(r: Redis, log: Log) -> EndpointStore:
    return EndpointStore(r, "", log, UrlPolicy(), lambda host: ["93.184.216.34"])  # type: ignore[arg-type]


def test_a_rotation_redis_applied_returns_its_new_secret_when_the_look_after_it_fails():
    """Given an endpoint, and Redis that saves its rotated secret and then fails the read after it,
    When the tenant rotates the secret,
    Then the rotation is answered with the new secret, which is the one Redis holds (before: 503 "nothing was
    changed", and the new secret, the only one signing after a day, was never shown to anyone)."""
    r = Redis({"ep_1": orjson.dumps(ENDPOINT.to_doc())}, failing=("hget",))
    log = Log()
    secret = _store(r, log).rotate_secret("acme", "ep_1")
    held = orjson.loads(r.held["ep_1"])
    assert [s["value"] for s in held["secrets"]] == [secret, "whsec_b2xk"]  # unsealed here (no sealing key)
    assert held == orjson.loads(orjson.dumps(log.last("endpoint/ep_1")))


def test_a_delete_redis_refuses_leaves_the_endpoint_in_the_log_as_redis_holds_it():
    """Given an endpoint, and Redis refusing the delete (after the log took its tombstone),
    When the tenant deletes it (and is answered 503: nothing changed),
    Then the log ends with the endpoint as Redis still holds it (before: with the tombstone: the workers skipped
    every delivery to an endpoint the API still listed and fanned events out to)."""
    r = Redis({"ep_1": orjson.dumps(ENDPOINT.to_doc())}, failing=("hdel",))
    log = Log()
    with pytest.raises(StoreUnavailable):
        _store(r, log).delete("acme", "ep_1")
    assert log.last("endpoint/ep_1") == orjson.loads(r.held["ep_1"])


@pytest.mark.parametrize("failure", ["Redis saved it, its answer lost", "the log left it unconfirmed"])
def test_a_create_answered_as_failed_leaves_the_endpoint_nowhere(failure):
    """Given Redis that saves a new endpoint and loses its answer, or an operator log that leaves the create's record
    unconfirmed (it may still be written),
    When a tenant creates an endpoint (and is answered 503: its secret is never shown),
    Then Redis does not hold it and the log ends with its tombstone (before: an endpoint Redis held, listed and fanned
    out to, that the log said was deleted, so every delivery to it was skipped; or one the log held and a rebuild
    of Redis would bring back, signed with a secret nobody has)."""
    r = Redis(failing=("save",) if failure.startswith("Redis") else ())
    log = Log(unconfirmed=0 if failure.startswith("Redis") else 1)
    with pytest.raises((StoreUnavailable, PublishOutcomeUnknown)):
        _store(r, log).create("acme", "https://hooks.example/x", ["*"])
    [key] = {k for k, _ in log.records}
    assert r.held == {} and log.last(key) is None


def test_a_delete_whose_answer_redis_lost_leaves_its_tombstone_in_the_log_while_redis_cannot_be_read():
    """Given an endpoint, and Redis that deletes it and loses the answer, then fails the look after it,
    When the tenant deletes it (503), and deletes it again (404: nothing left),
    Then the log ends with the tombstone (before: with the endpoint, which a rebuild of Redis from the log after a
    later data loss brought back, and events were fanned out to a URL the tenant had deleted)."""

    class DeletesThenStalls(Redis):
        def hdel(self, key, field):
            self.held.pop(field, None)
            self.failing.add("hget")
            raise redis.TimeoutError("Timeout reading from socket (test)")

    r = DeletesThenStalls({"ep_1": orjson.dumps(ENDPOINT.to_doc())})
    log = Log()
    store = _store(r, log)
    with pytest.raises(StoreUnavailable):
        store.delete("acme", "ep_1")
    r.reads, r.failing = 0, set()
    assert store.delete("acme", "ep_1") is False
    assert r.held == {} and log.last("endpoint/ep_1") is None
