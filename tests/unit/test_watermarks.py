"""The watermark read behind `streams dlq`: a partition whose leader is not yet known or has just moved is
asked again (with fresh metadata) instead of failing the operator's command."""

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from streams.kafka_client import watermarks


class ConsumerAnswering:
    """A consumer whose watermark reads fail with the given errors first, then answer (0, 7)."""

    def __init__(self, *errors: int) -> None:
        self.errors = list(errors)
        self.reads = 0
        self.metadata_refreshes = 0

    def get_watermark_offsets(self, tp, timeout, cached):
        assert not cached and timeout <= 3.0
        self.reads += 1
        if self.errors:
            # As confluent-kafka raises it: the retriable() flag is not set, whatever the code.
            raise KafkaException(KafkaError(self.errors.pop(0), "Failed to get watermark offsets"))
        return 0, 7

    def list_topics(self, topic, timeout):
        self.metadata_refreshes += 1


def test_a_partition_without_a_known_leader_is_asked_again_after_a_metadata_refresh():
    c = ConsumerAnswering(KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE, KafkaError._TIMED_OUT)
    assert watermarks(c, TopicPartition("notif.dlq", 3)) == (0, 7)
    assert c.reads == 4 and c.metadata_refreshes == 3


def test_an_error_that_asking_again_cannot_mend_is_raised_at_once():
    c = ConsumerAnswering(KafkaError.TOPIC_AUTHORIZATION_FAILED)
    with pytest.raises(KafkaException) as raised:
        watermarks(c, TopicPartition("notif.dlq", 3))
    assert raised.value.args[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED and c.reads == 1


def test_a_leader_that_never_comes_back_fails_once_the_time_is_up():
    c = ConsumerAnswering(*[KafkaError.NOT_LEADER_FOR_PARTITION] * 1000)
    with pytest.raises(KafkaException):
        watermarks(c, TopicPartition("notif.dlq", 3), timeout_s=0.5)
    assert 2 <= c.reads < 10
