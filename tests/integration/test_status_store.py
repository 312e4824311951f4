"""The status store on a real Redis: outcomes of one send applied by two writers at once (two outcome recorder
copies reading different partitions, or a recorder and `streams state recover`) end at the final status."""

import redis

from streams.ingest.status import StatusStore


class ReadsThenPauses(redis.Redis):
    """A client that, after reading a send's status, lets `meanwhile` run before answering (the other writer
    getting in between this writer's read and its write)."""

    meanwhile = None

    def hget(self, name, key):
        value = super().hget(name, key)
        if key == "status" and self.meanwhile is not None:
            run, self.meanwhile = self.meanwhile, None
            run()
        return value


def _event(status: str, attempts: int) -> dict:
    return {"send_id": "s-1", "tenant_id": "acme", "channel": "email", "lane": "transactional", "status": status,
            "attempts": attempts, "completed_at_ms": 1_700_000_000_000 + attempts, "provider": "resend"}


def test_a_retrying_outcome_applied_while_another_writer_records_delivered_never_ends_over_it(
        stack, redis_client, namespace):
    """Given a send's `retrying` outcome (attempt 1) applied by one writer and its `delivered` outcome (attempt 2)
    by another, the second getting in just after the first has looked at the current status,
    When both are applied,
    Then the send is `delivered` after 2 attempts. Before, the first writer read the status, then wrote in a
    separate step: it wrote `retrying` over the `delivered` written in between, and the send showed `retrying`
    for good."""
    slow = StatusStore(ReadsThenPauses.from_url(stack.redis_url), namespace)
    other = StatusStore(redis_client, namespace)
    slow.client.meanwhile = lambda: other.record_outcome(_event("delivered", 2))

    slow.record_outcome(_event("retrying", 1))
    if slow.client.meanwhile is not None:  # compared and written in one step: the other writer comes after
        slow.client.meanwhile()

    doc = other.get("s-1")
    assert (doc["status"], doc["attempts"]) == ("delivered", 2), doc
