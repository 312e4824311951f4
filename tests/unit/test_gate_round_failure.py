"""A dispatch round's admissions that a failing Redis Cluster master cut short are given back: the tokens the
healthy masters granted in that round are not spent on requests that are never sent."""

import pytest
import redis

from streams.errors import GateUnavailable
from streams.gate.gate import RedisGate
from streams.redis_client import load_script

REFUND = load_script("streams.gate", "refund.lua")


class Script:
    def __init__(self, source):
        self.source = source

    def __call__(self, keys, args, client):
        client.calls.append((self.source, keys, args))


class Pipeline:
    def __init__(self, owner):
        self.owner, self.calls = owner, []

    def execute(self, raise_on_error=True):
        if all(source == REFUND for source, _, _ in self.calls):
            self.owner.refunded += [(keys[2], args) for _, keys, args in self.calls]
            assert not raise_on_error, "a refund's error must come back alone, not re-send the others"
            return [redis.ConnectionError("the master is down (test)") if self.owner.refund_fails else 1
                    for _ in self.calls]
        return self.owner.replies


class Client:
    """Redis as a pipeline of gate scripts sees it: scripted replies, refunds recorded."""

    def __init__(self, replies, refund_fails=False):
        self.replies, self.refund_fails = replies, refund_fails
        self.refunded: list = []

    def register_script(self, source):
        return Script(source)

    def pipeline(self, transaction=True):
        return Pipeline(self)


def test_the_admissions_of_a_round_cut_short_by_a_failing_master_are_given_back():
    """Given a round of three admissions whose first and third buckets answer (admitted) and whose second's master
    is down,
    When the round is asked for,
    Then it fails (GateUnavailable: dispatch holds) and the first and third admissions are given back, each to its
    own tenant's bucket (before: kept, so those tokens were spent on requests never sent)."""
    client = Client([[1, 0, b""], redis.ConnectionError("master down (test)"), [1, 0, b""]])
    gate = RedisGate(client, "ns.")  # type: ignore[arg-type]
    with pytest.raises(GateUnavailable):
        gate.acquire_many([("resend", "acme", 100, False), ("resend", "globex", 100, False),
                           ("resend", "initech", 50, False)])
    assert client.refunded == [("ns.dr:{resend}:tenant:acme", ["acme", 1, 100]),
                               ("ns.dr:{resend}:tenant:initech", ["initech", 1, 50])]


def test_a_round_whose_give_back_fails_too_still_fails_as_the_gate_unavailable():
    client = Client([[1, 0, b""], redis.ConnectionError("master down (test)")], refund_fails=True)
    gate = RedisGate(client, "ns.")  # type: ignore[arg-type]
    with pytest.raises(GateUnavailable, match="master down"):
        gate.acquire_many([("resend", "acme", 100, False), ("resend", "globex", 100, False)])
    assert len(client.refunded) == 1
