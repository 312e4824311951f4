"""A tenant's sender domains and project members, written to the operator log and then to Redis: a write Redis
refuses is taken back out of the log (which the workers follow, and from which a lost Redis is rebuilt)."""

import orjson
import pytest
import redis

from streams.errors import StoreUnavailable
from streams.ingest.members import MemberStore
from streams.ingest.sender_store import SenderDomainStore


class RefusingWrites:
    """Answers reads; refuses every write (a Redis Cluster master failing over, say)."""

    def __init__(self, held: dict[str, bytes] | None = None, fields: dict[str, bytes] | None = None):
        self.held, self.fields = dict(held or {}), dict(fields or {})

    def register_script(self, text):
        return lambda keys, args, client=None: 0

    def get(self, key):
        return self.held.get(key)

    def hget(self, key, field):
        return self.fields.get(field)

    def set(self, *args, **kwargs):
        raise redis.ConnectionError("Connection refused (test)")

    def hdel(self, *args):
        raise redis.ConnectionError("Connection refused (test)")


class Log:
    def __init__(self):
        self.records: list[tuple[str, dict | None]] = []

    def put(self, key, value):
        self.records.append((key, value))


def test_a_removal_of_sender_domains_redis_refuses_is_taken_back_out_of_the_log():
    """Given acme's operator-set sender domains, and Redis refusing their removal (answered 503),
    Then the log ends with acme's domains as Redis holds them (before: with the removal, which a rebuild of Redis
    from the log would apply, widening acme's senders back to the defaults)."""
    r, log = RefusingWrites(fields={"acme": orjson.dumps(["acme.test"])}), Log()
    with pytest.raises(StoreUnavailable):
        SenderDomainStore(r, "", log).remove("acme")  # type: ignore[arg-type]
    assert log.records[-1] == ("senders/acme", {"domains": ["acme.test"]})


def test_project_members_redis_refuses_are_taken_back_out_of_the_log():
    """Given acme's project members (who get its endpoint-health alerts), and Redis refusing a new list (503),
    Then the log ends with the list Redis still holds (before: with the refused one, which the workers follow: alerts
    went to addresses the operator was told were not added)."""
    held = orjson.dumps({"tenant": "acme", "emails": ["ops@acme.test"]})
    r, log = RefusingWrites(), Log()
    store = MemberStore(r, "", log)  # type: ignore[arg-type]
    r.held = {store.keys.members("acme"): held}
    with pytest.raises(StoreUnavailable):
        store.set("acme", ["new@acme.test"])
    assert log.records[-1] == ("members/acme", orjson.loads(held))
