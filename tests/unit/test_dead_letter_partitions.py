"""Where a send's dead letter may be: the partitions its key maps to at the DLQ's partition count or any smaller."""

from streams.kafka_client import partition_for
from streams.retry.dlq import key_partitions


def test_a_keys_partitions_are_the_current_one_first_then_those_of_every_smaller_count():
    """Given send ids and DLQ partition counts from 1 to 12,
    When the partitions a send's dead letter may be in are listed,
    Then the one the current count maps it to comes first, each partition once, and every partition a smaller count
    mapped it to is among them (nothing else is)."""
    for n in range(100):
        key = f"send-{n}".encode()
        for count in range(1, 13):
            listed = key_partitions(key, count)
            assert listed[0] == partition_for(key, count)
            assert len(listed) == len(set(listed))
            assert set(listed) == {partition_for(key, smaller) for smaller in range(1, count + 1)}
    assert key_partitions(b"any", 1) == [0]
