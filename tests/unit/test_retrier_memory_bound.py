"""The retrier's memory bound counts what it released and the lane has not acknowledged yet: those copies
are still in its process (payload and all), so a lane topic that does not acknowledge (an ACL, a partition
without its replicas) cannot make it read on without bound. No broker: the consumer records pauses and the
producer never acknowledges."""

from streams.kafka_client import AckedWriter
from streams.retry.retrier import Held, Retrier, RetrierConfig
from tests.harness import PauseRecordingConsumer


class SilentProducer:
    """The broker takes records and never acknowledges them."""

    def produce(self, topic, value=None, key=None, headers=None, on_delivery=None):
        pass

    def poll(self, timeout=0):
        return 0

    def flush(self, timeout=0):
        return 1


def _retrier(now_ms: float) -> Retrier:
    r = Retrier(RetrierConfig("email", "marketing", "127.0.0.1:1", max_held=1_000, max_held_bytes=100_000),
                clock=lambda: now_ms / 1000)
    r.consumer.close()
    r.consumer = PauseRecordingConsumer()  # type: ignore[assignment]
    r.writer = AckedWriter(SilentProducer(), "test")  # type: ignore[arg-type]
    return r


def test_released_copies_the_lane_has_not_acknowledged_count_against_the_byte_bound():
    """Given a retrier bounded to 100 kB, holding one message due in an hour on the 1h tier's partition,
    When it releases 15 due copies of 10 kB each that the lane never acknowledges,
    Then it pauses the partition holding the late message only (150 kB unacknowledged is past the bound; before,
    only the held heap's bytes counted, and it read on)."""
    now = 1_000_000_000_000
    r = _retrier(now)
    hour_tier, ten_s_tier = r.cfg.topics[4], r.cfg.topics[0]
    r.assigned = {(hour_tier, 0), (ten_s_tier, 0)}
    late = Held(now + 3_600_000, 1, hour_tier, 0, None, b"x" * 100, {})
    r.heap, r.held_bytes = [late], late.size
    for offset in range(15):
        r._republish(Held(now, offset, ten_s_tier, 0, None, b"y" * 10_000, {}), now)
    assert r.writer.pending == 15
    r._bound_memory()
    assert r.consumer.paused == {(hour_tier, 0)}


class _Message:
    def __init__(self, topic, partition, offset):
        self._where = (topic, partition, offset)

    def error(self): return None
    def topic(self): return self._where[0]
    def partition(self): return self._where[1]
    def offset(self): return self._where[2]
    def headers(self): return []
    def key(self): return None
    def value(self): return b"{}"


def test_a_message_of_a_partition_revoked_after_the_poll_returned_it_is_not_held():
    """librdkafka serves a revoke in the consume that follows the poll, after the poll returned a message of the
    revoked partition. Held, that message would bring the partition's offsets back into this retrier (stored
    below the new owner's commit should the partition come back); its new owner reads it again."""
    now = 1_000_000_000_000
    r = _retrier(now)
    tier = r.cfg.topics[0]
    r.assigned = {(tier, 0)}
    r._hold(_Message(tier, 1, 40))
    r._hold(_Message(tier, 0, 7))
    assert [(h.partition, h.offset) for h in r.heap] == [(0, 7)]
    assert set(r.tracker.committable()) == {(tier, 0)}
