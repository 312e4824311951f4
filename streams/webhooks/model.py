"""A webhook endpoint as tenants register it, and its health. Pure code.

An endpoint belongs to one tenant: a URL, a description, the event types it subscribes to (`*` for
all), `enabled` (the tenant's switch), a configured `state` (`disabled` after the receiver answered
410 Gone) and its signing secrets (the current one first; after a rotation the previous one stays
valid 24 h, and both sign). Its health (`active` or `degraded` after 10 consecutive failures) is
kept by the endpoint-health app and published on `notif.endpoint.state`; `with_health` combines the
two into the state everyone shows and acts on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

STATES = ("active", "degraded", "disabled")


@dataclass(frozen=True)
class Secret:
    value: str = field(repr=False)  # never in a log line or a traceback's repr
    expires_at_ms: int | None = None  # None: the current secret


@dataclass(frozen=True)
class Endpoint:
    id: str
    tenant: str
    url: str
    event_types: tuple[str, ...]
    description: str = ""
    enabled: bool = True
    state: str = "active"
    state_reason: str = ""
    secrets: tuple[Secret, ...] = ()
    created_at_ms: int = 0

    def subscribes(self, event_type: str) -> bool:
        return "*" in self.event_types or event_type in self.event_types

    @property
    def deliverable(self) -> bool:
        return self.enabled and self.state == "active"

    def signing_secrets(self, now_ms: int) -> list[str]:
        return [s.value for s in self.secrets if s.expires_at_ms is None or s.expires_at_ms > now_ms]

    def public(self) -> dict[str, Any]:
        """What the API shows (never the secrets)."""
        doc = asdict(self)
        doc.pop("secrets")
        doc["event_types"] = list(self.event_types)
        return doc

    def to_doc(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> Endpoint:
        """Unknown fields (written by a newer version) are ignored; missing required ones raise."""
        known = {k: v for k, v in doc.items() if k in _ENDPOINT_FIELDS}
        return cls(**{**known, "event_types": tuple(doc["event_types"]),
                      "secrets": tuple(Secret(**{k: v for k, v in s.items() if k in _SECRET_FIELDS})
                                       for s in doc.get("secrets", ()))})


@dataclass(frozen=True)
class Health:
    """An endpoint's health as the endpoint-health app published it on `notif.endpoint.state`."""

    state: str = "active"   # active | degraded
    reason: str = ""
    since_ms: int = 0


_ENDPOINT_FIELDS = frozenset(f.name for f in fields(Endpoint))
_SECRET_FIELDS = frozenset(f.name for f in fields(Secret))


def with_health(ep: Endpoint, health: Health | None) -> Endpoint:
    """A disabled endpoint stays disabled; otherwise a degraded health makes it degraded."""
    if ep.state == "disabled" or health is None or health.state == "active":
        return ep
    return replace(ep, state=health.state, state_reason=health.reason)
