"""Where a send's time goes inside a lane worker, from the worker's own clock readings (wall clock,
milliseconds): consumed (returned by the consumer), dequeued (taken from its tenant queue for a
request), admitted (processed_jobs read and the gate passed), claimed, sent (handed to the provider
adapter), answered (the provider's answer collected), acked (the outcome event acknowledged by the
broker), marked (the `delivered` mark written; its offset is stored in the same step).

Off unless `DUAL_RAIL_STAGE_LOG` names a file (the latency benchmark sets it): then one JSON line
per delivered send is appended there.
"""

from __future__ import annotations

import threading
import time
from typing import IO

import orjson

STAGES = ("consumed", "dequeued", "admitted", "claimed", "sent", "answered", "acked", "marked")


def wall_ms() -> float:
    return time.time() * 1000


class StageLog:
    def __init__(self, path: str | None):
        self._out: IO[bytes] | None = open(path, "ab") if path else None  # noqa: SIM115 - held for the process
        self._lock = threading.Lock()

    @property
    def on(self) -> bool:
        return self._out is not None

    def write(self, send_id: str, created_at_ms: int, stamps: dict[str, float]) -> None:
        if self._out is None:
            return
        line = orjson.dumps({"send_id": send_id, "created_at_ms": created_at_ms, **stamps}) + b"\n"
        with self._lock:
            self._out.write(line)
            self._out.flush()
