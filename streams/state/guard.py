"""Detecting that Redis lost its data, and rebuilding the operator state it held.

Redis holds an epoch id, written once per data set and recorded in the operator log. When Redis
has no epoch but the log has one, Redis lost its data (restarted without persistence, flushed,
failed over to an empty replica): every role that notices it rebuilds the operator state (limits,
API keys, endpoints, project members) from the log by itself, and dispatch holds, failing closed,
because the delivery marks (`processed_jobs`) are gone and re-sending everything is worse than
waiting. It holds until an operator runs `streams state recover` (which rebuilds the marks from
`notif.outcomes`, then writes the epoch back) or `streams state acknowledge-loss`.
"""

from __future__ import annotations

import logging
import time
import uuid

import orjson
import redis

from .. import metrics
from ..names import RedisKeys
from ..redis_client import store_errors
from .log import OperatorLog

log = logging.getLogger("streams.state")
CHECK_EVERY_S = 5.0


def log_epoch(snapshot: dict[str, dict]) -> str | None:
    """The epoch the operator log records (None: none, or one that is not a string, which no role writes)."""
    epoch = (snapshot.get("epoch") or {}).get("epoch")
    return epoch if isinstance(epoch, str) and epoch else None


def restore(client: redis.Redis, keys: RedisKeys, snapshot: dict[str, dict]) -> int:
    """Write the operator state of a log snapshot into Redis; returns the entries written."""
    pipe = client.pipeline(transaction=False)
    written = 0
    for key, value in snapshot.items():
        kind, _, name = key.partition("/")
        if kind == "limits" and value:
            scalars = {k: v for k, v in value.items() if isinstance(v, int) and not isinstance(v, bool)}
            if len(scalars) < len(value):  # limits are integers (LimitStore reads them so); never written otherwise
                log.error("operator entry %r: skipping %d limit field(s) that are not integers", key,
                          len(value) - len(scalars))
            if not scalars:
                continue
            pipe.hset(keys.limits(name), mapping=scalars)
        elif kind == "apikey":
            pipe.hset(keys.api_keys, name, orjson.dumps(value))
        elif kind == "endpoint" and isinstance(value.get("tenant"), str):
            pipe.hset(keys.endpoints(value["tenant"]), name, orjson.dumps(value))
        elif kind == "members" and value:
            pipe.set(keys.members(name), orjson.dumps(value))
        else:
            continue
        written += 1
    with store_errors("restoring operator state"):
        pipe.execute()
    return written


class StateGuard:
    def __init__(self, client: redis.Redis, keys: RedisKeys, oplog: OperatorLog, role: str):
        self.client, self.keys, self.oplog, self.role = client, keys, oplog, role
        self.lost = False
        self._verified = False  # compared with the operator log at least once
        self._next_check = 0.0

    def check(self, force: bool = False) -> bool:
        """True while Redis holds its data (at most one Redis read every CHECK_EVERY_S)."""
        now = time.monotonic()
        if not force and now < self._next_check:
            return not self.lost
        self._next_check = now + CHECK_EVERY_S
        with store_errors("reading the Redis epoch"):
            present = self.client.get(self.keys.epoch)
        if present is not None and not self.lost and self._verified:
            return True
        self._evaluate(present.decode() if present else None)
        metrics.REDIS_STATE_LOST.set(1 if self.lost else 0)
        return not self.lost

    def recheck(self) -> None:
        """Something else saw Redis without its epoch: the next `check` reads it, cached or not."""
        self._next_check = 0.0

    def _evaluate(self, redis_epoch: str | None) -> None:
        snapshot = self.oplog.snapshot()
        if redis_epoch is None:
            # Read Redis again after the log: a role that wrote the first epoch sets Redis before the
            # log, so a log entry newer than our first read must not look like a loss.
            with store_errors("reading the Redis epoch"):
                present = self.client.get(self.keys.epoch)
            redis_epoch = present.decode() if present else None
        self._verified = True
        recorded = log_epoch(snapshot)
        if redis_epoch is not None and redis_epoch == recorded:
            if self.lost:
                log.warning("%s: Redis state recovered (epoch %s); resuming", self.role, redis_epoch)
            self.lost = False
        elif redis_epoch is not None and recorded is None:
            self.oplog.put("epoch", {"epoch": redis_epoch})  # an existing Redis, first seen by the log
            self.lost = False
        elif redis_epoch is None and recorded is None:
            self._first_epoch()
        else:
            written = restore(self.client, self.keys, snapshot)
            if not self.lost:
                log.error("%s: Redis has lost its data (epoch %s expected, found %s): restored %d operator "
                          "entries from the operator log; dispatch holds until an operator runs "
                          "`streams state recover`", self.role, recorded, redis_epoch, written)
            self.lost = True

    def _first_epoch(self) -> None:
        """A new deployment: the first role to start writes the epoch (one wins in Redis)."""
        with store_errors("writing the Redis epoch"):
            self.client.set(self.keys.epoch, uuid.uuid4().hex, nx=True)
            winner = self.client.get(self.keys.epoch).decode()
        self.oplog.put("epoch", {"epoch": winner})
        self.lost = False
