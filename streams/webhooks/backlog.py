"""Backlog shedding: an endpoint whose undelivered backlog is extreme gets no new deliveries; new
events for it are recorded as skipped (`backlog_shed`), replayable for 7 days like any payload.

This is separate from degradation (10 consecutive failures). An endpoint that still answers now
and then never reaches 10 failures in a row, yet can fall days behind; shedding protects the
platform from it. "Extreme" (`fanout.BacklogLimit`) takes both thresholds at once: at least
WEBHOOK_BACKLOG_MAX_COUNT undelivered deliveries (default 10,000) EACH at least
WEBHOOK_BACKLOG_MAX_AGE_S old (default 6 h, when a delivery that keeps failing is on its 7th
attempt). A count alone would shed a healthy endpoint draining a burst; an age alone, or a count
beside one old delivery, one straggler.

The backlog is a Redis sorted set per endpoint (delivery id -> creation time): ingest adds each
delivery it enqueues before publishing it (after, the outcome recorder could remove a delivery
delivered meanwhile before it was added, leaving it counted for days) and takes it out again if the
broker refuses the publish whole; the outcome recorder removes it when it finishes (delivered,
dropped, skipped). An entry whose outcome never came is forgotten after 3 days, longer than any delivery
lives (the webhook policy's max_age is 2 days).
"""

from __future__ import annotations

import redis

from ..names import RedisKeys
from ..redis_client import store_errors
from ..send import Send

FORGET_AFTER_MS = 3 * 24 * 3600 * 1000


class EndpointBacklog:
    def __init__(self, client: redis.Redis, namespace: str = ""):
        self.client, self.keys = client, RedisKeys(namespace)

    def overdue(self, endpoint_ids: list[str], created_before_ms: int) -> dict[str, int]:
        """How many undelivered deliveries of each endpoint were created at or before `created_before_ms` (one
        round trip)."""
        if not endpoint_ids:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for endpoint_id in endpoint_ids:
            pipe.zcount(self.keys.endpoint_backlog(endpoint_id), "-inf", created_before_ms)
        with store_errors("reading endpoint backlogs"):
            answers = pipe.execute()
        return {e: int(n) for e, n in zip(endpoint_ids, answers, strict=True)}

    def enqueued(self, deliveries: list[Send], now_ms: int) -> None:
        pipe = self.client.pipeline(transaction=False)
        for d in deliveries:
            key = self.keys.endpoint_backlog(d.payload["endpoint_id"])
            pipe.zadd(key, {d.send_id: d.created_at_ms})
            pipe.zremrangebyscore(key, 0, now_ms - FORGET_AFTER_MS)
            pipe.pexpire(key, FORGET_AFTER_MS)
        with store_errors("recording endpoint backlogs"):
            pipe.execute()

    def withdrawn(self, deliveries: list[Send]) -> None:
        """Deliveries counted, then not published after all."""
        pipe = self.client.pipeline(transaction=False)
        for d in deliveries:
            pipe.zrem(self.keys.endpoint_backlog(d.payload["endpoint_id"]), d.send_id)
        with store_errors("recording endpoint backlogs"):
            pipe.execute()
