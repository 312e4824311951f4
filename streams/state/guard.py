"""Detecting that Redis lost its data, and rebuilding the operator state it held.

Redis holds an epoch id, written once per data set and recorded in the operator log. When Redis
has no epoch but the log has one, Redis lost its data (restarted without persistence, flushed,
failed over to an empty replica): the first role to notice it rebuilds the operator state (limits,
API keys, endpoints, project members, sender domains) from the log by itself, writing only what Redis
lacks, each hash slot once after it lost its data (so no stale snapshot is written back over a change
made since; see `restore`), and dispatch holds, failing closed,
because the delivery marks (`processed_jobs`) are gone and re-sending everything is worse than
waiting. It holds until an operator runs `streams state recover` (which rebuilds the marks from
`notif.outcomes`, then writes the epoch back) or `streams state acknowledge-loss --yes`.

A claim reads the epoch in the same script (`streams/dispatch/claim.lua`) and claims nothing without
it. On a Redis Cluster the epoch lives in one hash slot, and a script reaches only its own slot, so
there the epoch is written with a marker in each of the 16,384 slots (markers first, then the log,
then the epoch; the log's entry says the markers exist): a claim reads its own slot's marker, and the
guard reads one marker of each master with the epoch every 5 s (the first slot the client knows it
to serve) and 128 slots' more in turn (every slot once in about 11 minutes: a slot a master was
given empty later is not its first), and every marker when it starts and when a claim or that look
saw one missing; while it holds, one per master until they are all back, then every marker before
it resumes. That is how
every role sees the loss of a shard other than the epoch's. A single Redis loses all or nothing, so
there the epoch is every slot's marker.
"""

from __future__ import annotations

import logging
import math
import time
import uuid

import orjson
import redis
from redis.crc import key_slot

from .. import metrics
from ..errors import DispatchError, PublishError, StackError, StoreUnavailable
from ..names import HASH_SLOTS, RedisKeys
from ..redis_client import is_cluster, store_errors
from .log import OperatorLog

log = logging.getLogger("streams.state")
CHECK_EVERY_S = 5.0
UNREADABLE_LOG_EVERY_S = 10.0  # how often a role says, once more, that it cannot read the operator log
UNFINISHED_AGAIN_S = 0.5  # a check Redis failing stopped is tried again this soon (one read); the log's, as usual
# Markers the 5 s look reads besides each master's first: every slot is read once in 128 looks (about
# 11 minutes). Measured on a 3-master local cluster: such a look takes 6.5-7 ms of the caller's thread
# (2.3-2.9 ms without the sweep), once every 5 s.
SWEEP_SLOTS = 128


def log_epoch(snapshot: dict[str, dict]) -> str | None:
    """The epoch the operator log records (None: none, or one that is not a string, which no role writes)."""
    epoch = (snapshot.get("epoch") or {}).get("epoch")
    return epoch if isinstance(epoch, str) and epoch else None


WRITING = "writing"  # the log's record while a role writes the markers for an epoch from before them


def markers_recorded(snapshot: dict[str, dict]) -> bool:
    """Whether the log's epoch was written with its hash-slot markers, on a Redis Cluster (an epoch
    written before them, or on a single Redis, has none)."""
    return (snapshot.get("epoch") or {}).get("markers") is True


def write_markers(client: redis.Redis, keys: RedisKeys) -> None:
    """On a Redis Cluster, the epoch's marker in every hash slot (one round trip per node)."""
    if not is_cluster(client):
        return
    pipe = client.pipeline(transaction=False)
    for key in keys.epoch_markers():
        pipe.set(key, b"1")
    with store_errors("writing the epoch's hash-slot markers"):
        pipe.execute()


def missing_markers(client: redis.Redis, keys: RedisKeys) -> int:
    """On a Redis Cluster, how many hash slots have lost their epoch marker."""
    if not is_cluster(client):
        return 0
    markers = keys.epoch_markers()
    with store_errors("reading the epoch's hash-slot markers"):
        return len(markers) - int(client.exists(*markers))


def a_master_lost_its_markers(client: redis.Redis, keys: RedisKeys, sweep_from: int | None = None) -> bool:
    """On a Redis Cluster, whether a master has lost its data: one marker read per master, from the
    first slot it serves (a master loses all its data or none; a resharded slot takes its marker along).
    With `sweep_from`, also the markers of the SWEEP_SLOTS slots from there: a slot a master was given
    empty after its first (`CLUSTER ADDSLOTS` after a shard died) is read within one sweep of all slots."""
    if not is_cluster(client):
        return False
    first_slot: dict[str, int] = {}
    for slot, nodes in client.nodes_manager.slots_cache.items():  # one pass, no sort: it runs every 5 s
        if slot < first_slot.get(nodes[0].name, HASH_SLOTS):
            first_slot[nodes[0].name] = slot
    slots = set(first_slot.values())
    if sweep_from is not None:
        slots.update(sweep(sweep_from))
    markers = [keys.epoch_marker(slot) for slot in slots]
    with store_errors("reading the epoch's hash-slot markers"):
        return int(client.exists(*markers)) < len(markers)


def sweep(start: int) -> range:
    """The slots one look sweeps from `start` (a multiple of SWEEP_SLOTS, which divides HASH_SLOTS)."""
    return range(start, start + SWEEP_SLOTS)


def slots_lost(missing: int) -> str:
    return f"{missing} of the {HASH_SLOTS} hash slots have lost their epoch marker"


def write_epoch(client: redis.Redis, keys: RedisKeys, oplog: OperatorLog, epoch: str) -> None:
    """Markers, then the operator log, then Redis's epoch: once the epoch is back, every slot has its marker."""
    write_markers(client, keys)
    oplog.put("epoch", {"epoch": epoch, "markers": is_cluster(client)})
    with store_errors("writing the Redis epoch"):
        client.set(keys.epoch, epoch)


def _limit_number(v: object) -> bool:
    """An integer, or a finite fraction (a rate below one a second, or per minute)."""
    return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and math.isfinite(v))


def restore(client: redis.Redis, keys: RedisKeys, snapshot: dict[str, dict], who: str = "state") -> int:
    """Write the operator state of a log snapshot into Redis, in the hash slots not yet restored since they lost
    their data; returns how many entries it wrote (and says so in the log, as `who`). Each slot's `restored` marker
    is written after its entries and lives in the slot, so it goes with the slot's data (a shard of a cluster lost
    later is restored too), and a slot is restored once: a later look's snapshot is never written over changes made
    since (an endpoint deleted during the hold would come back). Never over what Redis holds (HSETNX, SET NX): an
    entry changed before the marker was written (a key revoked, an endpoint moved) keeps its change."""
    planned: list[tuple[str, str, str | None, bytes | float]] = []  # (entry, Redis key, hash field or None, value)
    for key, value in snapshot.items():
        kind, _, name = key.partition("/")
        if kind == "limits" and value:
            scalars = {k: v for k, v in value.items() if _limit_number(v)}
            if len(scalars) < len(value):  # limits are numbers (LimitStore reads them so); never written otherwise
                log.error("operator entry %r: skipping %d limit field(s) that are not numbers", key,
                          len(value) - len(scalars))
            planned += [(key, keys.limits(name), field, number) for field, number in scalars.items()]
        elif kind == "apikey":
            planned.append((key, keys.api_keys, name, orjson.dumps(value)))
        elif kind == "endpoint" and isinstance(value.get("tenant"), str):
            planned.append((key, keys.endpoints(value["tenant"]), name, orjson.dumps(value)))
        elif kind == "members" and value:
            planned.append((key, keys.members(name), None, orjson.dumps(value)))
        elif kind == "senders" and isinstance(value, dict) and isinstance(value.get("domains"), list):
            planned.append((key, keys.sender_domains, name, orjson.dumps(value["domains"])))
    slot_of = {k: key_slot(k.encode()) for _, k, _, _ in planned}
    slots = sorted(set(slot_of.values()))
    with store_errors("reading which hash slots' operator state is restored"):
        pipe = client.pipeline(transaction=False)
        for slot in slots:
            pipe.exists(keys.restored_marker(slot))
        done = {slot for slot, n in zip(slots, pipe.execute(), strict=True) if n}
    todo = [w for w in planned if slot_of[w[1]] not in done]
    if not todo:
        return 0
    with store_errors("restoring operator state"):
        pipe = client.pipeline(transaction=False)
        for _, k, field, v in todo:
            if field is None:
                pipe.set(k, v, nx=True)
            else:
                pipe.hsetnx(k, field, v)
        pipe.execute()
        pipe = client.pipeline(transaction=False)  # after the entries: a slot marked is a slot restored
        for slot in {slot_of[k] for _, k, _, _ in todo}:
            pipe.set(keys.restored_marker(slot), b"1")
        pipe.execute()
    written = len({entry for entry, *_ in todo})
    log.warning("%s: restored %d operator entries from the operator log", who, written)
    return written


class StateGuard:
    def __init__(self, client: redis.Redis, keys: RedisKeys, oplog: OperatorLog, role: str):
        self.client, self.keys, self.oplog, self.role = client, keys, oplog, role
        self.lost = False
        self._verified = False  # compared with the operator log at least once
        self._markers_due = True  # read every hash slot's marker at the next check
        self._next_check = 0.0
        self._sweep_from = 0  # the slots the next look sweeps start here
        self._unfinished: DispatchError | None = None  # why the last check could not finish

    def check(self, force: bool = False) -> bool:
        """True while Redis holds its data (at most one Redis read every CHECK_EVERY_S). A check that could not
        finish (Redis or the operator log failing) is raised, and raised again (its class, its message) until one
        finishes (tried again after UNFINISHED_AGAIN_S when Redis failed): the guard never says Redis holds its
        data when it could not tell (an answer kept from before let an operator's replay be claimed while Redis,
        come back empty, was being recovered: a send replayed twice)."""
        now = time.monotonic()
        if not force and now < self._next_check:
            if self._unfinished is not None:
                raise type(self._unfinished)(*self._unfinished.args)
            return not self.lost
        self._next_check = now + CHECK_EVERY_S
        try:
            intact = self._look()
        except (StoreUnavailable, StackError, PublishError) as exc:
            again_s = UNFINISHED_AGAIN_S if isinstance(exc, StoreUnavailable) else CHECK_EVERY_S
            self._next_check, self._unfinished = now + again_s, exc
            raise
        self._unfinished = None
        return intact

    def _look(self) -> bool:
        with store_errors("reading the Redis epoch"):
            present = self.client.get(self.keys.epoch)
        if present is not None and not self.lost and self._verified and not self._markers_due:
            try:
                lost = a_master_lost_its_markers(self.client, self.keys, self._sweep_from)
            except StoreUnavailable:
                return True  # a master that does not answer: claims there fail closed; look again next time
            self._sweep_from = (self._sweep_from + SWEEP_SLOTS) % HASH_SLOTS
            if not lost:
                return True
            self._markers_due = True
        self._evaluate(present.decode() if present else None)
        metrics.REDIS_STATE_LOST.set(1 if self.lost else 0)
        return not self.lost

    def recheck(self) -> None:
        """A claim met a slot without its epoch marker: the next `check` reads the epoch and every
        marker, cached or not."""
        self._markers_due = True
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
            if is_cluster(self.client) and not markers_recorded(snapshot):
                if not self._adopt_markers(redis_epoch, snapshot):
                    return
            elif self.lost or self._markers_due:
                if self.lost and a_master_lost_its_markers(self.client, self.keys):
                    self._hold("a master's epoch markers are still missing", snapshot)  # no need to read them all
                    return
                missing = missing_markers(self.client, self.keys)
                self._markers_due = False
                if missing:
                    self._hold(slots_lost(missing), snapshot)
                    return
            if self.lost:
                log.warning("%s: Redis state recovered (epoch %s); resuming", self.role, redis_epoch)
            self.lost = False
        elif redis_epoch is not None and recorded is None:
            # An existing Redis, first seen by the log.
            if self._adopt_markers(redis_epoch, snapshot):
                self.lost = False
        elif redis_epoch is None and recorded is None:
            self._first_epoch()
        else:
            self._hold(f"epoch {recorded} expected, found {redis_epoch}", snapshot)

    def _adopt_markers(self, epoch: str, snapshot: dict[str, dict]) -> bool:
        """An epoch the log does not record with markers (written before them, by an older version, on a
        single Redis whose data moved to a cluster, or not in the log at all) is recorded with them. On a
        Redis Cluster the log first records that markers are being written, then they are written.
        Some slots with a marker and others without means those slots lost their data (hold: False),
        unless the log, read again after counting, records such a writing: another role's, interrupted
        or under way (write them), or finished meanwhile (count again)."""
        if is_cluster(self.client):
            missing = missing_markers(self.client, self.keys)
            if 0 < missing < HASH_SLOTS:
                recorded_now = (self.oplog.snapshot().get("epoch") or {}).get("markers")
                if recorded_now is True:  # another role wrote them all meanwhile
                    missing = missing_markers(self.client, self.keys)
                if missing and recorded_now != WRITING:
                    self._hold(slots_lost(missing), snapshot)
                    return False
            if missing:
                self.oplog.put("epoch", {"epoch": epoch, "markers": WRITING})
                write_markers(self.client, self.keys)
        self.oplog.put("epoch", {"epoch": epoch, "markers": is_cluster(self.client)})
        self._markers_due = False
        return True

    def _hold(self, why: str, snapshot: dict[str, dict]) -> None:
        if not self.lost:  # said before the restore, which may fail: the loss is known whatever it does
            log.error("%s: Redis has lost its data (%s): dispatch holds until an operator runs `streams state "
                      "recover`", self.role, why)
        self.lost = True
        metrics.REDIS_STATE_LOST.set(1)
        restore(self.client, self.keys, snapshot, self.role)  # at every look: only slots not yet restored

    def _first_epoch(self) -> None:
        """A new deployment: the first role to start writes the epoch (one wins in Redis), its
        markers before it."""
        write_markers(self.client, self.keys)
        with store_errors("writing the Redis epoch"):
            self.client.set(self.keys.epoch, uuid.uuid4().hex, nx=True)
            winner = self.client.get(self.keys.epoch).decode()
        self.oplog.put("epoch", {"epoch": winner, "markers": is_cluster(self.client)})
        self._markers_due = False
        self.lost = False
