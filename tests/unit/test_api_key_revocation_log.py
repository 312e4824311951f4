"""A revocation Redis may have applied is never taken back out of the operator log (from which a lost Redis is
rebuilt) as a valid key."""

import orjson
import pytest
import redis

from streams.errors import StoreUnavailable
from streams.ingest.api_keys import ApiKeys, key_id


class StallingRedis:
    """Holds API keys; once `stall` is set, a compare-and-set runs and its answer is lost, and every read after it
    fails too (one stall)."""

    def __init__(self):
        self.held: dict[bytes, bytes] = {}
        self.stall = False

    def register_script(self, text):
        def run(keys, args, client=None):
            field, expected, value = args
            field = field.encode()
            if self.held.get(field) != expected:
                return 0
            self.held[field] = value
            if self.stall:
                raise redis.TimeoutError("Timeout reading from socket (test)")
            return 1
        return run

    def hset(self, key, field, value):
        self.held[field.encode()] = value

    def hgetall(self, key):
        return dict(self.held)

    def hget(self, key, field):
        if self.stall:
            raise redis.TimeoutError("Timeout reading from socket (test)")
        return self.held.get(field.encode())


class Log:
    def __init__(self):
        self.records: list[tuple[str, dict | None]] = []

    def put(self, key, value):
        self.records.append((key, value))


def test_a_revocation_whose_answer_redis_lost_stays_in_the_log_while_redis_cannot_be_read():
    """Given a tenant key, and Redis that applies its revocation and loses the answer, then fails the look after it,
    When an operator revokes the key (and is answered 503: retry),
    Then the operator log's last record of the key is the revoked one, as Redis holds it (before: the record before
    the revocation: `streams keys list`, reading Redis, showed the key revoked, and a later loss of Redis data
    rebuilt it valid from the log)."""
    r, log = StallingRedis(), Log()
    keys = ApiKeys(r, "", log)  # type: ignore[arg-type]
    token = keys.create("tenant", "acme")
    r.stall = True
    with pytest.raises(StoreUnavailable):
        keys.revoke(key_id(token))
    [held] = r.held.values()
    assert orjson.loads(held)["revoked_at_ms"]
    assert log.records[-1][1]["revoked_at_ms"] == orjson.loads(held)["revoked_at_ms"]
