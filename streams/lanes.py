"""The vocabulary of routing: channels, lanes, categories and topic names. Pure code.

Every channel has exactly two lanes. `transactional` and `product` sends travel in the
transactional lane, `marketing` sends in the marketing lane; nothing else is a category.
"""

from __future__ import annotations

from dataclasses import dataclass

CHANNELS: tuple[str, ...] = ("email", "sms", "webhook")
LANES: tuple[str, ...] = ("transactional", "marketing")
CATEGORY_TO_LANE: dict[str, str] = {
    "transactional": "transactional",
    "product": "transactional",
    "marketing": "marketing",
}
# Delayed-retry tiers: the webhook schedule (10 s ... 12 h); other policies use a prefix of it.
RETRY_TIERS: dict[str, int] = {
    "10s": 10, "1m": 60, "5m": 300, "15m": 900, "1h": 3600, "3h": 10800, "6h": 21600, "12h": 43200,
}


def lane_for(category: str) -> str:
    """The lane a category travels in. Raises KeyError for an unknown category."""
    return CATEGORY_TO_LANE[category]


@dataclass(frozen=True)
class TopicNames:
    """Topic and group names, optionally under a namespace prefix (tests use one each)."""

    namespace: str = ""

    def lane(self, channel: str, lane: str) -> str:
        return f"{self.namespace}notif.{channel}.{lane}"

    def retry(self, channel: str, lane: str, tier: str) -> str:
        return f"{self.namespace}notif.{channel}.{lane}.retry.{tier}"

    @property
    def dlq(self) -> str:
        return f"{self.namespace}notif.dlq"

    @property
    def outcomes(self) -> str:
        return f"{self.namespace}notif.outcomes"

    @property
    def lag(self) -> str:
        return f"{self.namespace}notif.lag"

    def group(self, channel: str, lane: str) -> str:
        return f"{self.namespace}dispatch.{channel}.{lane}"
