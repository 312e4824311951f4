"""A topic's partitions as the broker describes them: metadata that comes with an error is asked for again, and
one that never comes right is an error, never an empty topic (pure: a fake consumer)."""

from types import SimpleNamespace

import pytest

from streams.errors import BrokerUnavailable
from streams.kafka_client import topic_partitions


class Describing:
    """A consumer whose topic metadata carries an error and no partitions for its first `bad` answers."""

    def __init__(self, bad: int):
        self.bad, self.asked = bad, 0

    def list_topics(self, topic, timeout):
        self.asked += 1
        if self.asked <= self.bad:
            meta = SimpleNamespace(error="LEADER_NOT_AVAILABLE", partitions={})
        else:
            meta = SimpleNamespace(error=None, partitions={2: None, 0: None, 1: None})
        return SimpleNamespace(topics={topic: meta})


def test_metadata_with_an_error_is_asked_for_again_and_never_read_as_an_empty_topic():
    """Given a broker whose first two answers for the DLQ carry an error and no partitions (before: read as a topic of
    none, `streams dlq list` said "0 of 0 dead letters" and a recovery restored nothing, both as if complete),
    Then its partitions are those of the third answer; and a broker that never answers right is BrokerUnavailable."""
    describing = Describing(bad=2)
    assert topic_partitions(describing, "notif.dlq") == [0, 1, 2] and describing.asked == 3  # type: ignore[arg-type]
    with pytest.raises(BrokerUnavailable, match="LEADER_NOT_AVAILABLE"):
        topic_partitions(Describing(bad=10**9), "notif.dlq", timeout_s=0.5)  # type: ignore[arg-type]
