"""The unit of work inside a lane worker: one message taken from a lane topic, until its outcome
is durable (delivered and recorded, or copied to a retry tier or the DLQ)."""

from __future__ import annotations

from dataclasses import dataclass

from .send import Send

Offset = tuple[str, int, int]  # topic, partition, offset


@dataclass
class Pending:
    topic: str
    partition: int
    offset: int
    raw: bytes                 # the event's bytes, re-published unchanged to retry tiers and the DLQ
    headers: dict[str, bytes]
    send: Send
    attempt: int

    @property
    def where(self) -> Offset:
        return (self.topic, self.partition, self.offset)
