"""The lag readers keep working through what goes wrong around them: a direct read that fails in a way
nobody foresaw, and partitions added to the transactional lane at run time."""

import time
from types import SimpleNamespace

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
