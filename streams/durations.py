"""Durations as configuration files write them ('10s', '10m', '2h', '1d'). Pure code."""

from __future__ import annotations

import re

_DURATION = re.compile(r"^(\d+)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86_400}


def duration_s(raw: object) -> int | None:
    """The seconds `raw` says, or None when it is not such a duration (the caller names the field)."""
    m = _DURATION.match(raw) if isinstance(raw, str) else None
    return int(m.group(1)) * _UNIT_S[m.group(2)] if m else None
