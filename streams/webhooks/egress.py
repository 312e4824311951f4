"""Whether a failed connection is the receiver's or ours. Pure code; time is given.

One receiver that cannot be reached is that receiver's failure, and counts against its endpoint's health.
Our own way out failing (our name servers, an egress proxy, the worker's network) fails every receiver at
once: counted, it would degrade every endpoint that had deliveries during the outage and mail their
tenants' members about a failure that was ours. Only a worker sees both at once, so each worker watches its
own attempts: a failure to reach a receiver (no connection, no name lookup) is taken for ours
(`egress_unavailable`, which endpoint health leaves uncounted) while receivers of EGRESS_DOWN_TENANTS
different tenants, this one's included, could not be reached within the last EGRESS_WINDOW_S and no receiver
answered since, whatever it answered. Tenants, not receivers: a tenant may register any number of receivers
that refuse connections (or a name server of its own that never answers), and must not be able to make the
failures of other tenants' broken receivers go uncounted on its own. Any healthy traffic answers long before
that, so a few broken receivers among working ones still count as theirs (and a receiver still reachable
during an outage of ours, one whose address is still cached say, keeps the failures counted, as before). A
timeout is a failure to reach the receiver (`ConnectTimeout`) only when no connection opened within it (our
packets dropped; a TLS handshake that stalls too, which aiohttp does not tell apart); one after the connection
opened is the receiver's (a slow receiver). A worker whose receivers of three tenants or more are all broken
cannot tell the two apart; the WebhookEgressUnavailable alert says when failures go uncounted.
"""

from __future__ import annotations

from collections import OrderedDict

EGRESS_DOWN_TENANTS = 3
EGRESS_WINDOW_S = 300.0


class EgressWatch:
    def __init__(self, tenants: int = EGRESS_DOWN_TENANTS, window_s: float = EGRESS_WINDOW_S):
        self.tenants, self.window_s = tenants, window_s
        # The last `tenants` tenants whose receivers could not be reached since the last answer, with when (the
        # most recent last): all the answer needs, however many tenants fail.
        self._failed: OrderedDict[str, float] = OrderedDict()

    def answered(self) -> None:
        """A receiver answered (any HTTP status, or a TLS handshake that failed): our way out works."""
        self._failed.clear()

    def unreachable(self, tenant: str, now: float) -> bool:
        """A receiver of `tenant` could not be reached at `now`: whether our own way out looks down (the failure is
        ours)."""
        self._failed[tenant] = now
        self._failed.move_to_end(tenant)
        while len(self._failed) > self.tenants:
            self._failed.popitem(last=False)
        oldest = next(iter(self._failed.values()))
        return len(self._failed) >= self.tenants and now - oldest <= self.window_s
