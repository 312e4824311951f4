"""Whether a failed connection is the receiver's or ours. Pure code; time is given.

One receiver that cannot be reached is that receiver's failure, and counts against its endpoint's health.
Our own way out failing (our name servers, an egress proxy, the worker's network) fails every receiver at
once: counted, it would degrade every endpoint that had deliveries during the outage and mail their
tenants' members about a failure that was ours. Only a worker sees both at once, so each worker watches its
own attempts: once connections (or name lookups) to EGRESS_DOWN_HOSTS distinct receivers (host and port)
failed within EGRESS_WINDOW_S and none answered in between, a failure to reach a receiver is taken for ours
(`egress_unavailable`, which endpoint health leaves uncounted) until a receiver answers again, whatever it
answers. Any healthy traffic answers long before that, so a few broken receivers among working ones still
count as theirs. A timeout is neither: a slow receiver times out too. A worker whose every receiver is
broken cannot tell the two apart: once EGRESS_DOWN_HOSTS of them failed in one window its failures go
uncounted, and the WebhookEgressUnavailable alert says so.
"""

from __future__ import annotations

EGRESS_DOWN_HOSTS = 3
EGRESS_WINDOW_S = 300.0


class EgressWatch:
    def __init__(self, hosts: int = EGRESS_DOWN_HOSTS, window_s: float = EGRESS_WINDOW_S):
        self.hosts, self.window_s = hosts, window_s
        self._failed: dict[str, float] = {}  # receiver -> when a connection to it last failed, since the last answer

    def answered(self) -> None:
        """A receiver answered (any HTTP status): our way out works."""
        self._failed.clear()

    def unreachable(self, receiver: str, now: float) -> bool:
        """A connection to `receiver` failed at `now`: whether our own way out looks down (the failure is ours)."""
        self._failed[receiver] = now
        for name, at in list(self._failed.items()):
            if now - at > self.window_s:
                del self._failed[name]
        return len(self._failed) >= self.hosts

    @property
    def failing(self) -> int:
        """How many receivers could not be reached within the window, since the last answer."""
        return len(self._failed)
