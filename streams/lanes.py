"""The vocabulary of routing: channels, lanes, categories and retry tiers. Pure code.

Every channel has exactly two lanes. `transactional` and `product` sends travel in the
transactional lane, `marketing` sends in the marketing lane; nothing else is a category.
The type literals are the source; the tuples (CLI choices, topic expansion) derive from them.
"""

from __future__ import annotations

from typing import Literal, get_args

Channel = Literal["email", "sms", "webhook"]
Lane = Literal["transactional", "marketing"]
Category = Literal["transactional", "product", "marketing"]

CHANNELS: tuple[str, ...] = get_args(Channel)
LANES: tuple[str, ...] = get_args(Lane)
CATEGORIES: tuple[str, ...] = get_args(Category)
CATEGORY_TO_LANE: dict[str, Lane] = {
    "transactional": "transactional",
    "product": "transactional",
    "marketing": "marketing",
}
# Delayed-retry tiers: the webhook schedule (10 s ... 12 h); other policies use a prefix of it.
RETRY_TIERS: dict[str, int] = {
    "10s": 10, "1m": 60, "5m": 300, "15m": 900, "1h": 3600, "3h": 10800, "6h": 21600, "12h": 43200,
}


def lane_for(category: str) -> Lane:
    """The lane a category travels in. Raises KeyError for an unknown category."""
    return CATEGORY_TO_LANE[category]
