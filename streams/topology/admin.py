"""Reads topic state from a cluster and applies a plan (confluent-kafka AdminClient adapter).

Raising a replication factor is a partition reassignment (KIP-455: AlterPartitionReassignments,
then ListPartitionReassignments until it is done). librdkafka, and so confluent-kafka, has no call
for either, so this module sends those two requests itself, over the Kafka protocol, to any
broker (a KRaft broker forwards them to the active controller); likewise DescribeQuorum for the
local cluster's checks. Plaintext listeners only, like every Kafka client of the project.
"""

from __future__ import annotations

import itertools
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ConfigSource,
    NewPartitions,
    NewTopic,
    ResourceType,
)

from ..errors import StackError, TopicPlanError
from ..kafka_client import client_config
from .spec import Change, TopicSpec, TopicState, plan

TIMEOUT_S = 30.0
REASSIGN_TIMEOUT_S = 300.0  # how long `apply` waits for new replicas to catch up


class TopicAdmin:
    def __init__(self, bootstrap: str, reassign_timeout_s: float = REASSIGN_TIMEOUT_S):
        self.bootstrap = bootstrap
        self.admin = AdminClient(client_config(bootstrap, quiet=True))
        self.reassign_timeout_s = reassign_timeout_s

    def _metadata(self):
        try:
            return self.admin.list_topics(timeout=10.0)
        except KafkaException as exc:
            raise StackError(f"cannot reach Kafka at {self.bootstrap} ({exc.args[0].str()}); "
                             "is the stack up? (`streams dev up`)") from None

    def state(self, names: list[str]) -> dict[str, TopicState]:
        """Partitions and topic-level overrides of those of `names` that exist. A topic described with an error
        other than its absence (no leader for a moment; an ACL denying Describe) is asked about again for
        TIMEOUT_S, then StackError naming it: taken as missing, it was planned `create`, and the apply failed
        with "already exists", which said nothing of what was wrong."""
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            md = self._metadata()
            unclear = {n: md.topics[n].error for n in names if n in md.topics and md.topics[n].error is not None
                       and md.topics[n].error.code() != KafkaError.UNKNOWN_TOPIC_OR_PART}
            if not unclear:
                break
            if time.monotonic() >= deadline:
                raise StackError("cannot describe topic(s) " + ", ".join(f"{n} ({e.str()})" for n, e in
                                                                          sorted(unclear.items())))
            time.sleep(0.2)  # backoff before asking again, not synchronisation
        present = [n for n in names if n in md.topics and md.topics[n].error is None]
        if not present:
            return {}
        configs = self._overrides(present)
        out = {}
        for name in present:
            parts = md.topics[name].partitions
            # the fewest copies any partition has (a reassignment interrupted half-way shows as pending)
            rf = min(len(p.replicas) for p in parts.values()) if parts else 0
            out[name] = TopicState(len(parts), rf, configs.get(name, {}))
        return out

    def _overrides(self, names: list[str]) -> dict[str, dict[str, str]]:
        """Topic-level config overrides. With several brokers, one may not know a topic another has
        just listed (each applies the metadata log on its own): asked again, briefly."""
        configs: dict[str, dict[str, str]] = {}
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            resources = [ConfigResource(ResourceType.TOPIC, n) for n in names if n not in configs]
            unknown = []
            for res, fut in self.admin.describe_configs(resources, request_timeout=TIMEOUT_S).items():
                try:
                    entries = fut.result()
                except KafkaException as exc:
                    error = exc.args[0] if exc.args else None
                    if getattr(error, "code", lambda: None)() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                        unknown.append(res.name)
                        continue
                    raise StackError(f"cannot describe topic {res.name}: {error.str() if error else exc}") from None
                configs[res.name] = {k: e.value for k, e in entries.items()
                                     if e.source == ConfigSource.DYNAMIC_TOPIC_CONFIG.value}
            if not unknown:
                return configs
            if time.monotonic() > deadline:
                raise StackError(f"the brokers disagree on whether these topics exist: {sorted(unknown)}")
            time.sleep(0.2)

    def apply(self, changes: list[Change], specs: dict[str, TopicSpec]) -> None:
        refused = [c for c in changes if c.kind == "refused"]
        if refused:
            raise TopicPlanError("refusing to apply:\n" + "\n".join(f"  {c}" for c in refused))
        creates = [specs[c.topic] for c in changes if c.kind == "create"]
        if creates:
            self._wait(self.admin.create_topics(
                [NewTopic(s.name, num_partitions=s.partitions, replication_factor=s.replication_factor,
                          config=s.config) for s in creates], request_timeout=TIMEOUT_S))
            self._wait_visible({s.name: s.partitions for s in creates})
        grows = [NewPartitions(c.topic, c.partitions) for c in changes if c.kind == "add_partitions"]
        if grows:
            self._wait(self.admin.create_partitions(grows, request_timeout=TIMEOUT_S))
            self._wait_visible({g.topic: g.new_total_count for g in grows})
        # Replicas before configs: a higher min.insync.replicas only once there are copies to meet it.
        raises = {c.topic: c.replication_factor for c in changes if c.kind == "add_replicas"}
        if raises:
            self.raise_replication(raises)
        by_topic: dict[str, list[ConfigEntry]] = {}
        for c in changes:
            if c.kind == "set_config":
                by_topic.setdefault(c.topic, []).append(
                    ConfigEntry(c.key, c.value, incremental_operation=AlterConfigOpType.SET))
            elif c.kind == "delete_config":
                by_topic.setdefault(c.topic, []).append(
                    ConfigEntry(c.key, None, incremental_operation=AlterConfigOpType.DELETE))
        if by_topic:
            self._wait(self.admin.incremental_alter_configs(
                [ConfigResource(ResourceType.TOPIC, t, incremental_configs=e) for t, e in by_topic.items()],
                request_timeout=TIMEOUT_S))
        if changes:
            self._wait_brokers_agree(changes, specs)

    def raise_replication(self, targets: dict[str, int]) -> None:
        """Give every partition of these topics `targets[topic]` replicas by partition reassignment,
        and wait (at most `reassign_timeout_s`) until the new replicas are in sync. Existing replicas
        stay where they are, the leader first; new ones go to the brokers holding the fewest of the
        topic's replicas. Partitions that already have enough are left alone."""
        md = self.admin.list_topics(timeout=10.0)
        brokers = sorted(md.brokers)
        short = {t: rf for t, rf in targets.items() if rf > len(brokers)}
        if short:
            raise StackError(f"replication factor {max(short.values())} needs as many brokers, the cluster at "
                             f"{self.bootstrap} has {len(brokers)} ({', '.join(map(str, brokers))}): "
                             f"{', '.join(sorted(short))}")
        plan: dict[str, dict[int, list[int]]] = {}
        for topic, rf in sorted(targets.items()):
            if topic not in md.topics or md.topics[topic].error is not None:
                raise StackError(f"topic {topic} is not in the cluster's metadata; nothing was reassigned")
            current = {p: list(pm.replicas) for p, pm in md.topics[topic].partitions.items()}
            moves = place_replicas(current, rf, brokers)
            if moves:
                plan[topic] = moves
        if not plan:
            return
        errors = alter_partition_reassignments(self.bootstrap, plan, TIMEOUT_S)
        if errors:
            raise StackError("the cluster refused the partition reassignment: " + "; ".join(errors))
        self._wait_reassigned(plan)

    def _wait_reassigned(self, plan: dict[str, dict[int, list[int]]]) -> None:
        """Until no partition of `plan` is being reassigned and each has its target replicas, all in sync."""
        deadline = time.monotonic() + self.reassign_timeout_s
        pending: set[tuple[str, int]] = {(t, p) for t, parts in plan.items() for p in parts}
        while time.monotonic() < deadline:
            moving = list_partition_reassignments(self.bootstrap, {t: sorted(parts) for t, parts in plan.items()},
                                                  TIMEOUT_S)
            if not moving:
                md = self.admin.list_topics(timeout=10.0)
                pending = {(t, p) for t, parts in plan.items() for p, target in parts.items()
                           if t not in md.topics or p not in md.topics[t].partitions
                           or sorted(md.topics[t].partitions[p].replicas) != sorted(target)
                           or set(md.topics[t].partitions[p].isrs) != set(target)}
                if not pending:
                    return
            else:
                pending = set(moving)
            time.sleep(0.25)
        shown = ", ".join(f"{t}[{p}]" for t, p in sorted(pending)[:10]) + (" ..." if len(pending) > 10 else "")
        raise StackError(f"partition reassignment not finished after {self.reassign_timeout_s:.0f} s ({len(pending)} "
                         f"partition(s): {shown}); it goes on in the cluster: run `streams topics apply` again to "
                         "wait for it and apply the remaining changes (endpoint-health does so for its changelog "
                         "as it tries again)")

    def _wait_brokers_agree(self, changes: list[Change], specs: dict[str, TopicSpec],
                            timeout: float = TIMEOUT_S) -> None:
        """Until every broker shows what `changes` did. The controller acknowledges a change once it
        is in the metadata log; each broker applies the log on its own, and under load one may lag by
        seconds, so the next `plan` (on whichever broker the client asks) could show stale state.
        Each broker is asked directly. Best effort and bounded: a broker that does not answer (down)
        is skipped, and the wait ends at `timeout` without failing the apply, which has succeeded."""
        expected: dict[str, tuple[int, int, dict[str, str | None]]] = {}  # partitions, replicas, configs
        for c in changes:
            parts, rf, configs = expected.get(c.topic, (0, 0, {}))
            if c.kind == "create":
                spec = specs[c.topic]
                parts, rf, configs = spec.partitions, spec.replication_factor, {**configs, **spec.config}
            elif c.kind == "add_partitions":
                parts = max(parts, c.partitions)
            elif c.kind == "add_replicas":
                rf = max(rf, c.replication_factor)
            elif c.kind in ("set_config", "delete_config"):
                configs = {**configs, c.key: c.value if c.kind == "set_config" else None}
            expected[c.topic] = (parts, rf, configs)
        try:
            brokers = [f"{b.host}:{b.port}" for b in self.admin.list_topics(timeout=10.0).brokers.values()]
        except KafkaException:
            return
        topics = sorted(expected)
        deadline = time.monotonic() + timeout
        while brokers and time.monotonic() < deadline:
            lagging = []
            for address in brokers:
                try:
                    shown = broker_topics(address, topics)
                    overrides = broker_overrides(address, topics)
                except (StackError, OSError):
                    continue  # not answering: nothing to wait for there
                for topic, (parts, rf, configs) in expected.items():
                    replicas = shown.get(topic)
                    if (replicas is None or len(replicas) < parts or min(map(len, replicas.values()), default=0) < rf
                            or any(overrides.get(topic, {}).get(k) != v for k, v in configs.items())):
                        lagging.append(address)
                        break
            if not lagging:
                return
            brokers = lagging
            time.sleep(0.1)

    def _wait_visible(self, expected: dict[str, int]) -> None:
        """The controller acknowledges before every broker's metadata shows the change; wait for it
        so that a plan right after an apply sees what was applied."""
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                md = self.admin.list_topics(timeout=10.0)
            except KafkaException:
                time.sleep(0.1)
                continue  # the broker went away meanwhile: the deadline decides
            if all(n in md.topics and md.topics[n].error is None
                   and len(md.topics[n].partitions) >= p
                   and all(pm.leader >= 0 for pm in md.topics[n].partitions.values())
                   for n, p in expected.items()):
                return
            time.sleep(0.1)
        raise StackError(f"topics not visible in metadata after {TIMEOUT_S:.0f} s: {sorted(expected)}")

    def ensure(self, specs: dict[str, TopicSpec]) -> None:
        """Create or reconcile exactly these topics (tests, benchmarks and the demo use a subset)."""
        self.apply(plan(specs, self.state(list(specs))), specs)

    def create_missing(self, specs: dict[str, TopicSpec]) -> None:
        """Create those of `specs` that do not exist (another client creating one at the same moment is
        fine), raise the replication factor of those that exist with fewer replicas (and then set their
        configs, min.insync.replicas among them, as `topics apply` does; a topic of more replicas is left
        as it is), and return once the brokers show them all (each broker asked, best effort and bounded,
        as after an apply). Raises TopicPlanError when one exists with another partition count or a change
        `topics apply` would refuse (another cleanup.policy), and
        StackError when the broker cannot be reached, does not answer in time or refuses (the admin
        client does not say which refusals would pass: a caller that waits asks again)."""
        existing = self.state(list(specs))
        for name, state in existing.items():
            if state.partitions != specs[name].partitions:
                raise TopicPlanError(f"{name} has {state.partitions} partitions where {specs[name].partitions} "
                                     "are needed; recreate it deliberately")
        # A topic created before its replication profile was set (a first start without it) would otherwise keep
        # one copy for good: the endpoint-health changelog is not in topics/*.toml, `topics apply` never sees it.
        # Its configs are set on every call, not only with the raise: a call that raised the replicas and then
        # failed before the configs sees 3 replicas the next time.
        # A topic of more replicas than the spec (a copy started with a lower profile) is left as it is: its
        # configs (min.insync.replicas) go with its replicas.
        ours = {n: specs[n] for n, st in existing.items() if st.replication_factor <= specs[n].replication_factor}
        changes = plan(ours, existing)
        # A policy this tool would refuse to change (a changelog made by hand with cleanup.policy=delete ages its
        # state out) is not taken as it is: the role does not start on it.
        if refused := [c for c in changes if c.kind == "refused"]:
            raise TopicPlanError("; ".join(f"{c.topic}: {c.detail}" for c in refused))
        changes = [c for c in changes if c.kind in ("add_replicas", "set_config")]
        if changes:
            self.apply(changes, ours)
        missing = [s for name, s in specs.items() if name not in existing]
        if missing:
            futures = self.admin.create_topics(
                [NewTopic(s.name, num_partitions=s.partitions, replication_factor=s.replication_factor,
                          config=s.config) for s in missing], request_timeout=TIMEOUT_S)
            for name, fut in futures.items():
                try:
                    fut.result()
                except KafkaException as exc:
                    if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                        raise StackError(f"the broker refused to create {name}: {exc.args[0].str()}") from None
        # Also when it existed: another client may have created it a moment ago.
        self._wait_visible({name: s.partitions for name, s in specs.items()})
        self._wait_brokers_agree([Change(name, "add_partitions", "", partitions=s.partitions)  # its partitions only
                                  for name, s in specs.items()], specs)

    def named(self, prefix: str) -> list[str]:
        """The cluster's topics whose names start with `prefix` (a namespace)."""
        return sorted(name for name in self._metadata().topics if name.startswith(prefix))

    def delete(self, names: list[str]) -> None:
        """Delete topics (tests clean up their own namespaces with this)."""
        if names:
            self._wait(self.admin.delete_topics(names, request_timeout=TIMEOUT_S))

    @staticmethod
    def _wait(futures: dict) -> None:
        errors = []
        for key, fut in futures.items():
            try:
                fut.result()
            except KafkaException as exc:
                errors.append(f"{getattr(key, 'name', key)}: {exc.args[0].str() if exc.args else exc}")
        if errors:
            raise StackError("the broker refused: " + "; ".join(errors))


def place_replicas(current: dict[int, list[int]], rf: int, brokers: list[int]) -> dict[int, list[int]]:
    """Target replicas of the partitions of one topic that have fewer than `rf` (pure): the current
    replicas first, in order (the leader stays), then the brokers that hold the fewest of this topic's
    replicas so far (ties: the next brokers after the partition's leader, as Kafka places replicas)."""
    load = Counter(b for replicas in current.values() for b in replicas)
    order = {b: i for i, b in enumerate(sorted(brokers))}
    moves: dict[int, list[int]] = {}
    for p in sorted(current):
        replicas = list(current[p])
        if len(replicas) >= rf:
            continue
        lead = order.get(replicas[0], 0) if replicas else p % len(order)
        while len(replicas) < rf:
            free = [b for b in brokers if b not in replicas]
            pick = min(free, key=lambda b: (load[b], (order[b] - lead) % len(order)))
            replicas.append(pick)
            load[pick] += 1
        moves[p] = replicas
    return moves


# --------------------------------------------------------------------------------- Kafka protocol
# The few requests librdkafka does not offer, encoded by hand: flexible versions (compact strings and
# arrays, tagged fields), request header v2, response header v1. https://kafka.apache.org/protocol

_ERRORS = {
    3: "UNKNOWN_TOPIC_OR_PARTITION", 7: "REQUEST_TIMED_OUT", 29: "TOPIC_AUTHORIZATION_FAILED",
    31: "CLUSTER_AUTHORIZATION_FAILED", 35: "UNSUPPORTED_VERSION", 38: "INVALID_REPLICATION_FACTOR",
    39: "INVALID_REPLICA_ASSIGNMENT", 41: "NOT_CONTROLLER", 42: "INVALID_REQUEST", 85: "NO_REASSIGNMENT_IN_PROGRESS",
}
_RETRIABLE = {7, 41}
_correlation = itertools.count(1)
T = TypeVar("T")


def _error(code: int, message: str | None) -> str:
    return f"{_ERRORS.get(code, f'error code {code}')}{f' ({message})' if message else ''}"


class _Writer:
    def __init__(self) -> None:
        self.buf = bytearray()

    def int16(self, v: int) -> _Writer:
        self.buf += struct.pack(">h", v)
        return self

    def int32(self, v: int) -> _Writer:
        self.buf += struct.pack(">i", v)
        return self

    def uvarint(self, v: int) -> _Writer:
        while v >= 0x80:
            self.buf.append((v & 0x7F) | 0x80)
            v >>= 7
        self.buf.append(v)
        return self

    def string(self, s: str) -> _Writer:
        raw = s.encode()
        self.uvarint(len(raw) + 1)
        self.buf += raw
        return self

    def array(self, items: Iterable[T] | None, each: Callable[[_Writer, T], Any]) -> _Writer:
        if items is None:
            return self.uvarint(0)
        items = list(items)
        self.uvarint(len(items) + 1)
        for item in items:
            each(self, item)
        return self

    def tags(self) -> _Writer:
        return self.uvarint(0)


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def _unpack(self, fmt: str, size: int) -> int:
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return value

    def int16(self) -> int:
        return self._unpack(">h", 2)

    def int32(self) -> int:
        return self._unpack(">i", 4)

    def int64(self) -> int:
        return self._unpack(">q", 8)

    def uvarint(self) -> int:
        shift = value = 0
        while True:
            byte = self.data[self.pos]
            self.pos += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7

    def string(self) -> str | None:
        n = self.uvarint()
        if n == 0:
            return None
        s = self.data[self.pos:self.pos + n - 1].decode()
        self.pos += n - 1
        return s

    def array(self, each: Callable[[_Reader], T]) -> list[T]:
        n = self.uvarint()
        return [each(self) for _ in range(n - 1)] if n else []

    def tags(self) -> None:
        for _ in range(self.uvarint()):
            self.uvarint()
            self.pos += self.uvarint()


def _addresses(bootstrap: str) -> list[tuple[str, int]]:
    out = []
    for entry in bootstrap.split(","):
        entry = entry.strip().split("://")[-1]
        host, _, port = entry.rpartition(":")
        if host and port.isdigit():
            out.append((host.strip("[]"), int(port)))
    if not out:
        raise StackError(f"no broker address in {bootstrap!r}")
    return out


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the broker closed the connection")
        buf += chunk
    return bytes(buf)


def _call(bootstrap: str, api_key: int, version: int, body: _Writer, timeout: float) -> _Reader:
    """One request to the first broker of `bootstrap` that answers; the response body."""
    correlation = next(_correlation)
    head = _Writer().int16(api_key).int16(version).int32(correlation)
    head.buf += struct.pack(">h", len(b"dual-rail-topics")) + b"dual-rail-topics"  # client id: a non-compact string
    message = bytes(head.tags().buf) + bytes(body.buf)
    failures = []
    for host, port in _addresses(bootstrap):
        try:
            with socket.create_connection((host, port), timeout=timeout) as sock:
                sock.sendall(struct.pack(">i", len(message)) + message)
                (size,) = struct.unpack(">i", _recv(sock, 4))
                reader = _Reader(_recv(sock, size))
        except OSError as exc:
            failures.append(f"{host}:{port}: {exc}")
            continue
        if reader.int32() != correlation:
            raise StackError(f"broker {host}:{port} answered another request (correlation id mismatch)")
        reader.tags()
        return reader
    raise StackError(f"cannot reach Kafka at {bootstrap} ({'; '.join(failures)}); is the stack up?")


def _with_retries(attempt: Callable[[], T], timeout: float) -> T:
    """Retry while the cluster answers NOT_CONTROLLER / REQUEST_TIMED_OUT (an election going on)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return attempt()
        except _Retriable:
            if time.monotonic() > deadline:
                raise StackError(f"the Kafka controller did not answer within {timeout:.0f} s") from None
            time.sleep(0.5)


class _Retriable(Exception):
    pass


def alter_partition_reassignments(bootstrap: str, plan: dict[str, dict[int, list[int]]],
                                  timeout: float = TIMEOUT_S) -> list[str]:
    """AlterPartitionReassignments v0 (API key 45): start moving each partition of `plan` to its
    target replicas. Returns the per-partition refusals ("topic[partition]: ERROR (message)")."""

    def partition(w: _Writer, item: tuple[int, list[int]]) -> None:
        w.int32(item[0]).array(item[1], _Writer.int32).tags()

    def topic(w: _Writer, item: tuple[str, dict[int, list[int]]]) -> None:
        w.string(item[0]).array(sorted(item[1].items()), partition).tags()

    def attempt() -> list[str]:
        body = _Writer().int32(int(timeout * 1000)).array(sorted(plan.items()), topic).tags()
        r = _call(bootstrap, 45, 0, body, timeout)
        r.int32()  # throttle time
        code, message = r.int16(), r.string()
        if code in _RETRIABLE:
            raise _Retriable
        if code:
            return [_error(code, message)]

        def result(r: _Reader) -> tuple[int, int, str | None]:
            out = (r.int32(), r.int16(), r.string())
            r.tags()
            return out

        def topic_results(r: _Reader) -> tuple[str | None, list[tuple[int, int, str | None]]]:
            out = (r.string(), r.array(result))
            r.tags()
            return out

        refusals = [(t, p, c, m) for t, results in r.array(topic_results) for p, c, m in results if c]
        if refusals and all(c in _RETRIABLE for *_, c, _m in refusals):
            raise _Retriable
        return [f"{t}[{p}]: {_error(c, m)}" for t, p, c, m in refusals]

    return _with_retries(attempt, timeout)


def list_partition_reassignments(bootstrap: str, partitions: dict[str, list[int]] | None = None,
                                 timeout: float = TIMEOUT_S) -> list[tuple[str, int]]:
    """ListPartitionReassignments v0 (API key 46): the (topic, partition) pairs being reassigned,
    among `partitions` (None: in the whole cluster)."""

    def topic(w: _Writer, item: tuple[str, list[int]]) -> None:
        w.string(item[0]).array(item[1], _Writer.int32).tags()

    def attempt() -> list[tuple[str, int]]:
        body = _Writer().int32(int(timeout * 1000))
        body.array(None if partitions is None else sorted(partitions.items()), topic).tags()
        r = _call(bootstrap, 46, 0, body, timeout)
        r.int32()  # throttle time
        code, message = r.int16(), r.string()
        if code in _RETRIABLE:
            raise _Retriable
        if code:
            raise StackError(f"listing partition reassignments failed: {_error(code, message)}")

        def ongoing(r: _Reader) -> int:
            index = r.int32()
            for _ in range(3):  # replicas, adding, removing
                r.array(_Reader.int32)
            r.tags()
            return index

        def topic_result(r: _Reader) -> list[tuple[str, int]]:
            name = r.string() or ""
            out = [(name, p) for p in r.array(ongoing)]
            r.tags()
            return out

        return [pair for pairs in r.array(topic_result) for pair in pairs]

    return _with_retries(attempt, timeout)


def broker_serves(address: str, timeout: float = 1.0) -> int | None:
    """The node id of the broker at `address` (host:port) if it serves requests now (a KRaft broker
    does once it has caught up with the metadata log and is unfenced), else None. Metadata v12
    (API key 3) for no topic, sent to that broker only."""
    body = _Writer().uvarint(1)  # topics: an empty array
    body.buf += b"\x00\x00"  # allow_auto_topic_creation, include_topic_authorized_operations: false
    try:
        r = _call(address, 3, 12, body.tags(), timeout)
    except (StackError, OSError, struct.error):
        return None

    def broker(r: _Reader) -> tuple[int, str | None, int]:
        node_id, host, port = r.int32(), r.string(), r.int32()
        r.string()  # rack
        r.tags()
        return node_id, host, port

    r.int32()  # throttle time
    host, _, port = address.rpartition(":")
    return next((n for n, h, p in r.array(broker) if h == host and str(p) == port), None)


def broker_topics(address: str, topics: list[str], timeout: float = 5.0) -> dict[str, dict[int, list[int]]]:
    """What the broker at `address` itself knows of `topics` (Metadata v12, answered from its own
    metadata cache): {topic: {partition: replicas}}, for the topics it knows without error."""
    def topic(w: _Writer, name: str) -> None:
        w.buf += bytes(16)  # topic id: zero, the topic is named
        w.string(name).tags()

    body = _Writer().array(topics, topic)
    body.buf += b"\x00\x00"  # allow_auto_topic_creation, include_topic_authorized_operations: false
    r = _call(address, 3, 12, body.tags(), timeout)
    r.int32()  # throttle time

    def broker(r: _Reader) -> None:
        r.int32(), r.string(), r.int32(), r.string()  # node id, host, port, rack
        r.tags()

    def partition(r: _Reader) -> tuple[int, int, list[int]]:
        error, index = r.int16(), r.int32()
        r.int32(), r.int32()  # leader, leader epoch
        replicas = r.array(_Reader.int32)
        r.array(_Reader.int32), r.array(_Reader.int32)  # in sync, offline
        r.tags()
        return error, index, replicas

    def topic_result(r: _Reader) -> tuple[int, str | None, list[tuple[int, int, list[int]]]]:
        error, name = r.int16(), r.string()
        r.pos += 17  # topic id, is_internal
        parts = r.array(partition)
        r.int32()  # authorized operations
        r.tags()
        return error, name, parts

    r.array(broker)
    r.string(), r.int32()  # cluster id, controller id
    return {name: {index: replicas for _, index, replicas in parts}
            for error, name, parts in r.array(topic_result) if not error and name}


def broker_overrides(address: str, topics: list[str], timeout: float = 5.0) -> dict[str, dict[str, str | None]]:
    """The topic-level config overrides the broker at `address` itself shows (DescribeConfigs v4):
    {topic: {key: value}}, for the topics it knows."""
    def resource(w: _Writer, name: str) -> None:
        w.buf += b"\x02"  # resource type: topic
        w.string(name).array(None, _Writer.string).tags()  # every key

    body = _Writer().array(topics, resource)
    body.buf += b"\x00\x00"  # include_synonyms, include_documentation: false
    r = _call(address, 32, 4, body.tags(), timeout)
    r.int32()  # throttle time

    def synonym(r: _Reader) -> None:
        r.string(), r.string()
        r.pos += 1  # source
        r.tags()

    def entry(r: _Reader) -> tuple[str | None, str | None, int]:
        name, value = r.string(), r.string()
        r.pos += 1  # read only
        source = r.data[r.pos]
        r.pos += 2  # source, is_sensitive
        r.array(synonym)
        r.pos += 1  # config type
        r.string()  # documentation
        r.tags()
        return name, value, source

    def result(r: _Reader) -> tuple[int, str | None, list[tuple[str | None, str | None, int]]]:
        error = r.int16()
        r.string()  # error message
        r.pos += 1  # resource type
        name = r.string()
        entries = r.array(entry)
        r.tags()
        return error, name, entries

    dynamic_topic_config = 1
    return {name: {k: v for k, v, source in entries if k and source == dynamic_topic_config}
            for error, name, entries in r.array(result) if not error and name}


def describe_quorum(bootstrap: str, timeout: float = 10.0) -> tuple[int, int, int, dict[int, int], dict[int, int]]:
    """DescribeQuorum v0 (API key 55) of the KRaft metadata log: (leader id, leader epoch, high
    watermark, voters {id: log end offset}, observers {id: log end offset})."""

    def partition(w: _Writer, index: int) -> None:
        w.int32(index).tags()

    def topic(w: _Writer, name: str) -> None:
        w.string(name).array([0], partition).tags()

    def replica(r: _Reader) -> tuple[int, int]:
        out = (r.int32(), r.int64())
        r.tags()
        return out

    def attempt() -> tuple[int, int, int, dict[int, int], dict[int, int]]:
        r = _call(bootstrap, 55, 0, _Writer().array(["__cluster_metadata"], topic).tags(), timeout)
        code = r.int16()
        if code in _RETRIABLE:
            raise _Retriable
        if code:
            raise StackError(f"describing the metadata quorum failed: {_error(code, None)}")

        def part(r: _Reader) -> tuple[int, int, int, int, dict[int, int], dict[int, int]]:
            r.int32()  # partition index (the metadata log has one partition)
            err, leader, epoch, hw = r.int16(), r.int32(), r.int32(), r.int64()
            voters, observers = dict(r.array(replica)), dict(r.array(replica))
            r.tags()
            return err, leader, epoch, hw, voters, observers

        def topic_result(r: _Reader) -> list[tuple[int, int, int, int, dict[int, int], dict[int, int]]]:
            r.string()
            out = r.array(part)
            r.tags()
            return out

        parts = [p for t in r.array(topic_result) for p in t]
        if not parts:
            raise StackError("describing the metadata quorum returned no partition")
        err, leader, epoch, hw, voters, observers = parts[0]
        if err in _RETRIABLE:
            raise _Retriable
        if err:
            raise StackError(f"describing the metadata quorum failed: {_error(err, None)}")
        return leader, epoch, hw, voters, observers

    return _with_retries(attempt, timeout)
