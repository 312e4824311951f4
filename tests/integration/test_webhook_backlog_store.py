"""An endpoint's backlog in real Redis, as ingest reads it to decide whether new deliveries are shed: the
deliveries counted are the undelivered ones past the age, one by one."""

from streams.send import build_send, validate_request
from streams.webhooks.backlog import EndpointBacklog
from streams.webhooks.fanout import BacklogLimit, skip_reason
from tests.harness import webhook_event

HOUR_MS = 3600 * 1000
LIMIT = BacklogLimit(max_count=50, max_age_ms=6 * HOUR_MS)


def deliveries(endpoint_id: str, n: int, created_at_ms: int) -> list:
    req = validate_request(webhook_event())
    return [build_send(req.model_copy(update={"payload": {**req.payload, "endpoint_id": endpoint_id}}), "acme",
                       created_at_ms) for _ in range(n)]


def test_one_straggler_beside_a_fresh_burst_is_no_extreme_backlog(redis_client, namespace):
    """Given an endpoint whose backlog holds one delivery 7 h old (a retry that keeps failing) and a fresh burst
    of 50 (the count limit), and another endpoint holding 50 deliveries each 7 h old,
    When ingest reads both backlogs for a new event,
    Then the first endpoint's new delivery is enqueued (one straggler does not make a healthy endpoint draining a
    burst days behind: before, the burst's count and the straggler's age shed it), the second's is shed
    (backlog_shed), and an endpoint with no backlog counts nothing overdue."""
    backlog = EndpointBacklog(redis_client, namespace)
    now_ms = 100 * HOUR_MS
    old_ms = now_ms - 7 * HOUR_MS
    backlog.enqueued(deliveries("ep_draining", 1, old_ms) + deliveries("ep_draining", 50, now_ms - 1_000), now_ms)
    backlog.enqueued(deliveries("ep_behind", 50, old_ms), now_ms)

    overdue = backlog.overdue(["ep_draining", "ep_behind", "ep_new"], LIMIT.overdue_before_ms(now_ms))

    assert overdue == {"ep_draining": 1, "ep_behind": 50, "ep_new": 0}
    assert skip_reason(None, overdue["ep_draining"], LIMIT) is None
    assert skip_reason(None, overdue["ep_behind"], LIMIT) == "backlog_shed"
    assert skip_reason(None, overdue["ep_new"], LIMIT) is None
