"""The worker's per-tenant (per-endpoint) queues: what a long-running worker keeps of the tenants it served."""

from streams.dispatch.backlog import BacklogShare
from streams.dispatch.tenant_queues import REQUEST_BYTES, Pending, TenantQueues
from streams.send import build_send, encode, validate_request
from tests.harness import email_request


def _pending(tenant: str, offset: int) -> Pending:
    send = build_send(validate_request(email_request()), tenant)
    return Pending("lane", 0, offset, encode(send), {}, send, 1)


def test_the_queues_of_tenants_served_and_gone_are_dropped_and_a_held_one_is_kept():
    """Given a worker that served one send each for 10,000 tenants (a webhook worker: one queue per endpoint), one
    of whose queues is held 60 s (its receiver asked to wait),
    When the next step asks which queues are ready,
    Then only the held queue is left, with its hold (before: all 10,000 stayed, each step scanned them all, and
    a worker's step and memory grew for as long as it ran)."""
    queues = TenantQueues()
    for i in range(10_000):
        queues.add(_pending(f"tenant-{i}", i))
        [key] = queues.ready(0.0)
        queues.take(key, 1)
    queues.hold("tenant-7", 60.0)
    assert queues.ready(1.0) == [] and list(queues.queues) == ["tenant-7"]
    assert (queues.buffered, queues.buffered_bytes) == (0, 0)
    queues.add(_pending("tenant-7", 10_000))
    assert queues.ready(30.0) == [] and queues.ready(61.0) == ["tenant-7"]


def test_a_tenant_with_nothing_parked_ahead_is_not_kept_by_the_backlog_share():
    """Given a tenant whose messages were parked, all of them due by now,
    When its next message is within its share,
    Then nothing of it is kept (before: an empty entry for every tenant ever paced)."""
    share = BacklogShare(horizon_s=10.0)
    assert share.park("acme", 200, 10.0, 1, now=0.0) is not None  # 200 queued at 10/s: parked
    assert share.park("acme", 200, 10.0, 1, now=1000.0) is not None
    assert share.park("acme", 5, 10.0, 1, now=3000.0) is None
    assert "acme" not in share._last_due


def test_the_limits_read_for_tenants_served_long_ago_are_not_kept(monkeypatch):
    """Given a worker that read the bucket limits of 3,000 tenants, then, past the limits' time to live, of 1,200
    others,
    When the limits it keeps are counted,
    Then it keeps the 1,200 only (before: every tenant it ever served, for as long as it ran)."""
    from streams.dispatch import requests as requests_module
    from tests.unit.test_worker_loop import _messages, _worker

    worker, *_ = _worker(_messages(["acme"])[1])
    route, clock = worker.routes.primary, [1000.0]
    monkeypatch.setattr(requests_module.time, "monotonic", lambda: clock[0])
    for i in range(3000):
        worker.dispatcher.tenant_limit(route, f"tenant-{i}")
    clock[0] += requests_module.LIMITS_TTL_S + 1
    for i in range(3000, 4200):
        worker.dispatcher.tenant_limit(route, f"tenant-{i}")
    assert {tenant for _, tenant in worker.dispatcher._limits} == {f"tenant-{i}" for i in range(3000, 4200)}


def test_what_a_tenant_holds_is_counted_over_its_queues_and_forgotten_once_it_holds_nothing():
    """Given a tenant's messages over two queues, taken, put back, spliced and dropped with a revoked partition,
    Then the count its share of the buffer is measured against follows each change, over both queues, and nothing
    is kept for it once it holds nothing."""
    queues = TenantQueues(queue_key=lambda send: f"{send.tenant_id}-{send.correlation_id}")
    a = [_pending("acme", i) for i in range(4)]
    for i, p in enumerate(a):
        p.send = p.send.model_copy(update={"correlation_id": str(i % 2)})
        queues.add(p)
    assert queues.of_bucket[("acme", "")] == 4 and len(queues.queues) == 2
    taken = queues.take("acme-0", 2)
    assert queues.of_bucket[("acme", "")] == 2
    queues.put_back("acme-0", taken)
    assert queues.of_bucket[("acme", "")] == 4
    assert len(queues.splice("acme-1", [a[1].send.send_id])) == 1 and queues.of_bucket[("acme", "")] == 3
    queues.forget({("lane", 0)})
    assert queues.of_bucket == {} and queues.buffered == 0


def test_a_request_takes_at_most_request_bytes_of_messages_unless_one_alone_is_larger():
    """Given a tenant's queue of ten sends of about 900 KiB (large emails), then 100 small ones,
    When requests of up to 100 are taken,
    Then each takes at most REQUEST_BYTES together (4 of the large ones, not 100: each request's body goes through
    Redis before it is sent, 100 MB at once before), small ones fill a request as before, and a message larger
    than REQUEST_BYTES goes alone."""
    queues = TenantQueues()
    big = email_request(html="<p>" + "x" * 900 * 1024 + "</p>")
    for i in range(10):
        send = build_send(validate_request(big), "acme")
        queues.add(Pending("lane", 0, i, encode(send), {}, send, 1))
    for i in range(10, 110):
        queues.add(_pending("acme", i))
    sizes = []
    while queues.buffered:
        [key] = queues.ready(0.0)
        taken = queues.take(key, 100)
        assert sum(len(p.raw) for p in taken) <= REQUEST_BYTES
        sizes.append(len(taken))
    assert sizes == [4, 4, 100, 2]  # the last two large ones share a request with 98 small ones
    huge = Pending("lane", 0, 0, b"x" * (REQUEST_BYTES + 1), {}, build_send(validate_request(big), "acme"), 1)
    queues.add(huge)
    queues.add(_pending("acme", 1))
    assert queues.take("acme", 100) == [huge]
