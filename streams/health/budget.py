"""How many alert emails one tenant's endpoints may send. Pure code.

Alerts go out from the platform's own sender, on its transactional lane, to the addresses a tenant
listed: without a bound, a tenant with many endpoints that fail on purpose (and reactivates them)
could make that sender mail its list without end. Each copy of the endpoint-health app sends at most
ALERTS_PER_TENANT_PER_HOUR alerts of each kind per tenant in any hour; the rest are counted and
logged, not sent (the endpoints' state still changes, and shows in the API). Each kind has its own
count, so a burst of `dropped` alerts never uses up the room of a `stopped` or a `gone` one (an
endpoint disabled, which the tenant must hear about).
"""

from __future__ import annotations

from collections import deque

ALERTS_PER_TENANT_PER_HOUR = 20
HOUR_S = 3600.0


class AlertBudget:
    def __init__(self, per_hour: int = ALERTS_PER_TENANT_PER_HOUR):
        self.per_hour = per_hour
        self._sent: dict[tuple[str, str], deque[float]] = {}

    def take(self, tenant: str, kind: str, now_s: float) -> bool:
        """Whether one more alert of this kind for this tenant may go out now (and count it if so)."""
        sent = self._sent.setdefault((tenant, kind), deque())
        while sent and sent[0] <= now_s - HOUR_S:
            sent.popleft()
        if len(sent) >= self.per_hour:
            return False
        sent.append(now_s)
        return True
