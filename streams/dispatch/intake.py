"""What a consumed message becomes: a send to dispatch, or a rejection with a DLQ reason. Pure code."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from ..errors import MalformedEvent
from ..retry.policy import unknown_policy
from ..send import Send, decode


@dataclass(frozen=True)
class Admitted:
    send: Send
    attempt: int
    declined: int = 0  # of the attempts before it, those a provider declined with a 429 (not counted as tries)


@dataclass(frozen=True)
class Rejected:
    reason: str   # the DLQ `reason` header
    detail: str
    send: Send | None = None  # it was read as a send (refused for its payload, channel, lane, policy or attempt header)


def admit(value: bytes | None, headers: dict[str, bytes], channel: str, lane: str,
          policies: Collection[str]) -> Admitted | Rejected:
    try:
        send = decode(value)
    except MalformedEvent as exc:
        return Rejected(exc.reason, exc.detail, exc.send)
    except Exception as exc:  # noqa: BLE001 - an event no check foresaw is dead-lettered, never a crash loop
        return Rejected("malformed", f"the event cannot be read: {type(exc).__name__}")
    if send.channel != channel:
        return Rejected("channel_mismatch", f"a {send.channel} send on the {channel} lane topic", send)
    if lane == "transactional" and send.lane == "marketing":
        return Rejected("lane_violation", f"a {send.category} send may not travel in the transactional lane", send)
    if send.policy not in policies:
        return Rejected("unknown_policy", unknown_policy(send.policy, policies), send)
    attempt = _integer(headers, "attempt", b"1")
    if isinstance(attempt, str):
        return Rejected("malformed", attempt, send)
    if attempt < 1:
        return Rejected("malformed", f"header 'attempt' must be at least 1, got {attempt}", send)
    declined = _integer(headers, "declined", b"0")
    if isinstance(declined, str):
        return Rejected("malformed", declined, send)
    if not 0 <= declined < attempt:
        return Rejected("malformed", f"header 'declined' must be from 0 to {attempt - 1} (attempt {attempt}), "
                                     f"got {declined}", send)
    return Admitted(send, attempt, declined)


def _integer(headers: dict[str, bytes], name: str, absent: bytes) -> int | str:
    """A count dispatch writes in a header (`absent`: its value when there is none), or what is wrong with it."""
    raw = headers.get(name, absent)
    try:
        return int(raw)  # a header may also carry no value at all (None)
    except (ValueError, TypeError):
        return f"header '{name}' is not an integer: {repr(raw)[:30]}"
