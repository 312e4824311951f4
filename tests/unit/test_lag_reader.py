"""The lag readers keep working through what goes wrong around them: a direct read that fails in a way
nobody foresaw, and partitions added to the transactional lane at run time."""

import time
from types import SimpleNamespace

import pytest
from confluent_kafka import KafkaError

from streams.errors import StackError
from streams.lag import reader
from streams.lag.reader import BackgroundLagRead, LagReader
from streams.lag.yield_policy import LagReading
from tests.harness import wait_until


class FlakyReader:
    """A LagReader whose first read fails with an error no check foresaw."""

    reads = 0

    def __init__(self, bootstrap):
        pass

    def read(self, group, topic, source="monitor"):
        FlakyReader.reads += 1
        if FlakyReader.reads == 1:
            raise RuntimeError("something nobody foresaw")
        return LagReading(7, 0.0, int(time.time() * 1000), source)

    def close(self):
        pass


def test_a_direct_read_that_fails_unexpectedly_does_not_end_the_direct_reads(monkeypatch):
    """Given the background direct lag read, whose first read raises an error no check foresaw,
    When the worker asks again,
    Then a reading arrives (before, the thread died with the error, `request()` never started another, and a
    worker whose monitor was silent froze its yield decision for good)."""
    monkeypatch.setattr(reader, "LagReader", FlakyReader)
    direct = BackgroundLagRead("unused:9092", "group", "topic", every_s=0.01)
    try:
        direct.request()
        got = wait_until(lambda: direct.request() or direct.take(), 5, "a direct reading after the failure")
        assert got.lag_messages == 7 and FlakyReader.reads >= 2
    finally:
        direct.close()


def test_partitions_added_at_run_time_are_counted(monkeypatch):
    """Given a lane topic of 1 partition, later given a second (`streams topics apply`),
    When the reader lists its partitions after PARTITIONS_TTL_S,
    Then it sees both (before, the first listing was kept for good: the new partition's lag never counted,
    and marketing did not yield for it until the monitor and every worker restarted)."""
    lister = LagReader("127.0.0.1:9")
    lister.peeker.close()
    partitions = [{0: None}]
    lister.peeker = SimpleNamespace(list_topics=lambda topic, timeout: SimpleNamespace(
        topics={topic: SimpleNamespace(error=None, partitions=partitions[-1])}), close=lambda: None)
    monkeypatch.setattr(reader, "PARTITIONS_TTL_S", 0.0)
    assert lister.partitions("lane") == [0]
    partitions.append({0: None, 1: None})
    assert lister.partitions("lane") == [0, 1]


def test_a_failed_relisting_keeps_the_partitions_known(monkeypatch):
    """Given a reader that knows the lane's partitions, and a broker restarting (its metadata answers with an
    error for the topic),
    When the partitions are due to be listed again,
    Then the known ones are used and the next listing is a minute away (the read goes on, as before listings
    were repeated; failing it instead kept the lag monitor from publishing after a broker restart)."""
    lister = LagReader("127.0.0.1:9")
    lister.peeker.close()
    answers = [SimpleNamespace(error=None, partitions={0: None, 1: None}),
               SimpleNamespace(error="LEADER_NOT_AVAILABLE", partitions={})]
    asked = []

    def list_topics(topic, timeout):
        asked.append(topic)
        return SimpleNamespace(topics={topic: answers[min(len(asked), len(answers)) - 1]})

    lister.peeker = SimpleNamespace(list_topics=list_topics, close=lambda: None)
    assert lister.partitions("lane") == [0, 1]
    monkeypatch.setattr(reader, "PARTITIONS_TTL_S", 0.0)
    assert lister.partitions("lane") == [0, 1] and len(asked) == 2
    monkeypatch.setattr(reader, "PARTITIONS_TTL_S", 60.0)
    assert lister.partitions("lane") == [0, 1] and len(asked) == 2


class Event:
    """What a peeking consumer returns: a message of a partition, or the end of it (PARTITION_EOF)."""

    def __init__(self, partition: int, ts_ms: int | None = None):
        self._partition, self._ts = partition, ts_ms

    def partition(self):
        return self._partition

    def error(self):
        return None if self._ts is not None else KafkaError(KafkaError._PARTITION_EOF)

    def timestamp(self):
        return (1, self._ts)


def _reader_peeking(events: list[Event], *later: list[Event]) -> LagReader:
    """A reader of a lane of two partitions, each with 5 messages waiting, whose peeks return `events` once
    (then each of `later` once)."""
    lag = LagReader("127.0.0.1:9")
    lag.peeker.close()
    batches = [*reversed(later), events]
    lag.peeker = SimpleNamespace(assign=lambda heads: None, unassign=lambda: None, close=lambda: None,
                                 consume=lambda num_messages, timeout: batches.pop() if batches else [])
    lag.positions = lambda group, topic: {0: (0, 5), 1: (3, 8)}
    return lag


def test_a_lag_whose_waiting_messages_cannot_be_fetched_has_no_age_rather_than_none():
    """Given a transactional lane with messages waiting, none of which can be fetched within the read's second
    (a slow leader),
    When the lag is read,
    Then the read fails (the monitor publishes no reading for the lane, which goes stale, and marketing yields
    when nothing fresher comes), instead of a reading of age 0 s that lets marketing run while OTPs wait."""
    with pytest.raises(StackError, match="age of the lag"):
        _reader_peeking([]).read("group", "lane")


def test_a_lag_whose_heads_are_only_transaction_markers_reads_at_once_with_age_0():
    """Given a lane whose partitions' waiting offsets are transaction markers (never returned as messages),
    When the lag is read,
    Then the ends of the partitions answer at once (age 0, the markers still counted in the messages), without
    waiting out the read's second."""
    started = time.monotonic()
    reading = _reader_peeking([Event(0), Event(1)]).read("group", "lane")
    assert (reading.lag_messages, reading.lag_seconds) == (10, 0.0)
    assert time.monotonic() - started < 0.5


def test_the_age_of_the_lag_is_its_oldest_waiting_message():
    now_ms = int(time.time() * 1000)
    reading = _reader_peeking([Event(1, now_ms - 4_000), Event(0)]).read("group", "lane")
    assert 3.9 <= reading.lag_seconds < 5.0


def test_a_lag_one_of_whose_partitions_cannot_be_read_has_no_age_rather_than_the_others():
    """Given a lane of two partitions with messages waiting, one read (4 s old) and the other's head not fetched
    within the read's second (its leader slow or moving; its waiting OTPs could be minutes old),
    When the lag is read,
    Then the read fails rather than publish the read partition's 4 s as the lane's age."""
    now_ms = int(time.time() * 1000)
    with pytest.raises(StackError, match="1 partition"):
        _reader_peeking([Event(0, now_ms - 4_000)]).read("group", "lane")


def test_a_reading_is_as_old_as_its_first_look_at_the_broker(monkeypatch):
    """Given a broker slow enough that reading the lane's offsets takes 6 s (a metadata refresh, the commits, a
    watermark call per partition),
    When the lag is read,
    Then the reading is stamped when the read began (before: when it ended, so offsets 6 s old passed as fresh
    and marketing acted on them for the whole stale age after that)."""
    clock = [1_800_000_000.0]
    monkeypatch.setattr(reader, "time", SimpleNamespace(time=lambda: clock[0], monotonic=time.monotonic))
    lister = LagReader("127.0.0.1:9")
    lister.peeker.close()

    def slow_positions(group, topic):
        clock[0] += 6.0
        return {0: (10, 10), 1: (4, 4)}

    lister.positions = slow_positions  # type: ignore[method-assign]
    reading = lister.read("group", "lane")
    assert (reading.lag_messages, reading.ts_ms) == (0, 1_800_000_000_000)


def test_a_partition_that_ended_then_showed_a_message_does_not_end_the_read_before_the_others():
    """Given a lane of two partitions whose first peek ends partition 0 (its head an open transaction's record)
    and then shows its message once the transaction commits (1 s old), and whose partition 1 holds a message a
    minute old that comes in the next fetch,
    When the lag is read,
    Then its age is the minute (before: partition 0 counted twice, as ended and as read, stopped the read before
    partition 1, and the lane's age read 1 s while its OTPs waited a minute: marketing did not yield)."""
    now_ms = int(time.time() * 1000)
    reading = _reader_peeking([Event(0), Event(0, now_ms - 1_000)], [Event(1, now_ms - 60_000)]).read("g", "lane")
    assert 59.0 <= reading.lag_seconds < 61.0


def test_a_commit_outside_the_log_counts_the_lag_from_its_earliest_offset():
    """Given a lane whose group's commits lie past the log's end (the topic made anew under the group's old
    offsets) on partition 0 and before its start (deleted by retention) on partition 1,
    When the positions are read,
    Then each partition is positioned at its earliest offset, as its consumers will be (before: partition 0's
    lag read 0, and with the workers down the transactional lag stayed 0: marketing never yielded, no alert)."""
    lister = _lister({0: (0, 40), 1: (100, 130)}, [_committed(0, 900), _committed(1, 20)])
    assert lister.positions("g", "lane") == {0: (0, 40), 1: (100, 130)}


def test_a_commit_the_coordinator_could_not_give_fails_the_read_instead_of_counting_the_whole_log():
    """Given a lane whose group's committed offset of partition 1 comes back with an error (offset -1001),
    When the lag is read,
    Then the read fails saying so (the monitor keeps its last reading until a good one; workers fall back to
    reading the lag themselves), rather than taking the partition's 7 days of log for lag (before: marketing
    yielded, and TransactionalLagHigh paged, on that made-up number)."""
    error = KafkaError(KafkaError.COORDINATOR_LOAD_IN_PROGRESS)
    lister = _lister({0: (0, 40), 1: (0, 5_000_000)}, [_committed(0, 40), _committed(1, -1001, error)])
    with pytest.raises(StackError, match="cannot read the lag of g on lane"):
        lister.read("g", "lane")


def test_a_caller_that_needs_some_partitions_gets_those_whose_commit_came_back():
    """Given a group whose committed offset of partition 1 comes back with an error,
    When the endpoint-health app asks for the positions it needs (not `complete`),
    Then partition 0 is given and partition 1 left out, not positioned at its log's start (before: one partition's
    error, even one of another copy's, failed the app's whole stall check)."""
    error = KafkaError(KafkaError.COORDINATOR_LOAD_IN_PROGRESS)
    lister = _lister({0: (0, 40), 1: (0, 50)}, [_committed(0, 30), _committed(1, -1001, error)])
    assert lister.positions("g", "lane", complete=False) == {0: (30, 40)}


def _committed(partition: int, offset: int, error: KafkaError | None = None) -> SimpleNamespace:
    return SimpleNamespace(partition=partition, offset=offset, error=error)


def _lister(offsets: dict[int, tuple[int, int]], committed: list[SimpleNamespace]) -> LagReader:
    """A reader whose consumer answers these committed offsets and (low, high) watermarks."""
    lister = LagReader("127.0.0.1:9")
    lister.peeker.close()
    consumer = SimpleNamespace(committed=lambda parts, timeout: committed,
                               get_watermark_offsets=lambda tp, timeout, cached: offsets[tp.partition])
    lister._consumer = lambda group: consumer  # type: ignore[method-assign]
    lister.partitions = lambda topic: list(offsets)  # type: ignore[method-assign]
    return lister


def _reader_counting_peeks(positions: list[dict[int, tuple[int, int]]], heads_ms: dict[int, int | None]):
    """A reader whose lane's positions are `positions` on successive reads and whose peeks find, on each partition
    assigned, a message stamped `heads_ms[partition]` (None: its end, no message); the partitions each peek was
    assigned are listed."""
    lag = LagReader("127.0.0.1:9")
    lag.peeker.close()
    assigned: list[list[int]] = []
    waiting: list = []

    def assign(heads):
        assigned.append(sorted(tp.partition for tp in heads))
        waiting[:] = [Event(tp.partition, heads_ms[tp.partition]) for tp in heads]

    def consume(num_messages, timeout):
        taken, waiting[:] = list(waiting), []
        return taken

    lag.peeker = SimpleNamespace(assign=assign, unassign=lambda: None, close=lambda: None, consume=consume)
    reads = iter(positions)
    lag.positions = lambda group, topic: next(reads)  # type: ignore[method-assign]
    return lag, assigned


def test_a_head_read_before_at_the_same_position_is_not_fetched_again():
    """Given a lane of two partitions with messages waiting (a paused marketing lane behind a blast), read once,
    When it is read again with one partition's position unchanged and the other's moved on (a commit),
    Then only the moved partition's head is fetched (each fetch brings up to a megabyte of the backlog behind the
    head; before, every read fetched every head, four times a second), and the age is still the oldest head's,
    older by the time between the reads."""
    now_ms = int(time.time() * 1000)
    lag, assigned = _reader_counting_peeks([{0: (0, 5), 1: (3, 8)}, {0: (0, 6), 1: (4, 8)}, {0: (0, 6), 1: (4, 8)}],
                                           {0: now_ms - 60_000, 1: now_ms - 1_000})
    first = lag.read("group", "lane")
    second = lag.read("group", "lane")
    third = lag.read("group", "lane")
    assert assigned == [[0, 1], [1]]
    assert 60.0 <= first.lag_seconds <= second.lag_seconds <= third.lag_seconds < 61.0
    assert (second.lag_messages, third.lag_messages) == (10, 10)


def test_a_head_kept_too_long_is_fetched_again(monkeypatch):
    """Given a lane read once, whose positions have not moved since,
    When it is read again after HEAD_KEPT_S (a topic deleted and made anew counts its offsets from 0 again),
    Then its heads are fetched again."""
    lag, assigned = _reader_counting_peeks([{0: (0, 5)}, {0: (0, 5)}], {0: int(time.time() * 1000)})
    lag.read("group", "lane")
    monkeypatch.setattr(reader, "HEAD_KEPT_S", 0.0)
    lag.read("group", "lane")
    assert assigned == [[0], [0]]



def test_a_partition_whose_end_was_reached_without_a_message_is_fetched_again():
    """Given a lane whose waiting offsets were, at its last read, an open transaction's records (no message
    returned: the partition's end),
    When it is read again at the same position, the transaction committed meanwhile (its records 30 s old),
    Then the head is fetched again and the age is theirs (an end is never kept: kept, the lane would read 0 s old
    while its OTPs wait)."""
    heads: dict[int, int | None] = {0: None}
    lag, assigned = _reader_counting_peeks([{0: (2, 5)}, {0: (2, 5)}], heads)
    assert lag.read("group", "lane").lag_seconds == 0.0
    heads[0] = int(time.time() * 1000) - 30_000
    assert lag.read("group", "lane").lag_seconds >= 30.0
    assert assigned == [[0], [0]]
