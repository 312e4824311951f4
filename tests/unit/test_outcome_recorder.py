"""The outcome recorder's hold when Redis fails: what it kept is recorded again, and its partitions are read again,
also when a rebalance took every partition of what it kept. No broker, no Redis: a fake consumer and store."""

from types import SimpleNamespace

import orjson
from prometheus_client import REGISTRY

from streams.errors import StoreUnavailable
from streams.ingest.status import OutcomeRecorder


class Consumer:
    """Partitions 0 and 1 of the outcomes topic, assigned; `pending` is what the next poll returns."""

    def __init__(self):
        self.pending: list = []
        self.paused: set[int] = set()

    def assignment(self):
        return [SimpleNamespace(topic="notif.outcomes", partition=p) for p in (0, 1)]

    def pause(self, partitions):
        self.paused |= {p.partition for p in partitions}

    def resume(self, partitions):
        self.paused -= {p.partition for p in partitions}

    def poll(self, timeout=0):
        ready = [m for m in self.pending if m.partition() not in self.paused]
        if not ready:
            return None
        self.pending.remove(ready[0])
        return ready[0]

    def consume(self, num_messages=1, timeout=0):
        return []

    def store_offsets(self, message=None):
        pass

    def close(self):
        pass


class Store:
    def __init__(self):
        self.down = False
        self.recorded: list[str] = []

    def _answer(self):
        if self.down:
            raise StoreUnavailable("Redis: connection refused")

    def record_outcome(self, event):
        self._answer()
        self.recorded.append(event["send_id"])

    def ping(self):
        self._answer()


def _message(partition: int, send_id: str):
    value = orjson.dumps({"send_id": send_id, "tenant_id": "acme", "status": "delivered", "attempts": 1,
                          "completed_at_ms": 1})
    return SimpleNamespace(error=lambda: None, topic=lambda: "notif.outcomes", partition=lambda: partition,
                           offset=lambda: 0, value=lambda: value)


def test_a_recorder_whose_kept_events_a_rebalance_took_reads_its_other_partitions_again_once_redis_answers():
    """Given a recorder holding partition 0's event when Redis failed (both partitions paused),
    When a rebalance takes partition 0 (and what was kept of it), then Redis answers again and partition 1 has an
    event,
    Then the recorder resumes, records partition 1's event and no longer reports Redis down (before: only recording
    a kept event resumed the partitions, so with none left it stayed paused and reported Redis down for good: every
    send of partition 1 kept its old status)."""
    recorder = OutcomeRecorder("127.0.0.1:9", Store(), "notif.outcomes", "status-recorder")  # type: ignore[arg-type]
    recorder.consumer.close()
    recorder.consumer = consumer = Consumer()  # type: ignore[assignment]
    store = recorder.store
    store.down = True  # type: ignore[attr-defined]
    consumer.pending.append(_message(0, "s-0"))
    recorder.step()
    assert consumer.paused == {0, 1}
    recorder._forget(consumer, [SimpleNamespace(topic="notif.outcomes", partition=0)])
    store.down = False  # type: ignore[attr-defined]
    consumer.pending.append(_message(1, "s-1"))
    recorder.outage.next_try_at = 0.0  # its back-off has passed
    for _ in range(3):
        recorder.step()
    assert store.recorded == ["s-1"]  # type: ignore[attr-defined]
    assert consumer.paused == set()
    assert REGISTRY.get_sample_value("dispatch_dependency_down", {"role": "outcome-recorder",
                                                                  "dependency": "redis"}) == 0


class Guard:
    def __init__(self, failures: int):
        self.failures = failures

    def check(self):
        if self.failures:
            self.failures -= 1
            raise StoreUnavailable("Redis: connection refused")
        return True


def test_a_state_check_that_failed_once_on_a_quiet_topic_does_not_leave_redis_reported_down():
    """Given a recorder with no outcome to record, whose state check met Redis down once,
    When Redis answers again,
    Then the recorder reports Redis up again (before: only recording an event cleared it, so on a quiet topic
    dispatch_dependency_down stayed 1 and DispatchHoldingForDependency paged while Redis was fine)."""
    recorder = OutcomeRecorder("127.0.0.1:9", Store(), "notif.outcomes", "status-recorder",  # type: ignore[arg-type]
                               guard=Guard(failures=1))  # type: ignore[arg-type]
    recorder.consumer.close()
    recorder.consumer = Consumer()  # type: ignore[assignment]
    labels = {"role": "outcome-recorder", "dependency": "redis"}
    recorder.step()
    assert REGISTRY.get_sample_value("dispatch_dependency_down", labels) == 1
    recorder.outage.next_try_at = 0.0  # its back-off has passed
    recorder.step()
    assert REGISTRY.get_sample_value("dispatch_dependency_down", labels) == 0


class FailingGuard:
    """A state check that keeps failing with `error`."""

    def __init__(self, error: Exception):
        self.error = error

    def check(self):
        raise self.error


def test_a_recorder_whose_state_check_cannot_reach_redis_fetches_nothing_until_it_answers():
    """Given a recorder started while Redis does not answer (its state check fails, again and again), with outcome
    events waiting on both partitions,
    When it steps, before and after its back-off,
    Then it pauses its partitions and takes none of the events into memory (before: only a failed write paused them,
    which never came as the check kept failing, so the whole topic's lag was read into memory), and once Redis
    answers it resumes and records them."""
    recorder = OutcomeRecorder("127.0.0.1:9", Store(), "notif.outcomes", "status-recorder",  # type: ignore[arg-type]
                               guard=FailingGuard(StoreUnavailable("Redis: connection refused")))  # type: ignore[arg-type]
    recorder.consumer.close()
    recorder.consumer = consumer = Consumer()  # type: ignore[assignment]
    consumer.pending += [_message(0, "s-0"), _message(1, "s-1")]
    for _ in range(3):
        recorder.step()
        recorder.outage.next_try_at = 0.0  # its back-off has passed
    assert consumer.paused == {0, 1} and recorder.backlog == [] and len(consumer.pending) == 2
    recorder.guard = Guard(failures=0)  # type: ignore[assignment]
    for _ in range(4):
        recorder.step()
    assert sorted(recorder.store.recorded) == ["s-0", "s-1"]  # type: ignore[attr-defined]


def test_an_unreadable_operator_log_does_not_stop_statuses_being_recorded():
    """Given a recorder whose state check cannot read the operator log (a broker partition away, an ACL), Redis fine,
    When an outcome event comes,
    Then it is recorded (before: the recorder held, as for Redis down, and every status froze)."""
    from streams.errors import StackError

    recorder = OutcomeRecorder("127.0.0.1:9", Store(), "notif.outcomes", "status-recorder",  # type: ignore[arg-type]
                               guard=FailingGuard(StackError("notif.operator not readable")))  # type: ignore[arg-type]
    recorder.consumer.close()
    recorder.consumer = consumer = Consumer()  # type: ignore[assignment]
    consumer.pending.append(_message(0, "s-0"))
    recorder.step()
    assert recorder.store.recorded == ["s-0"]  # type: ignore[attr-defined]
