"""Publishing one request's records: all or nothing, waiting only for that request's own delivery
reports.

- One record is atomic by itself: it goes through a shared idempotent producer, and the request
  waits for its own delivery report (a future set by the producer's poll thread), never for other
  requests' messages.
- Several records (a batch, a webhook event's deliveries) go in one Kafka producer transaction on a
  transactional producer borrowed from a small pool: committed together or aborted together, also
  when the broker fails in the middle. Consumers read committed records only (librdkafka's default
  `isolation.level`), so an aborted batch is never dispatched.
- When the broker may have written what it did not confirm (a record's delivery failed with an error
  other than a refusal, or a batch's commit was asked and could not be aborted):
  `PublishOutcomeUnknown`, never "not published". The API then keeps the request's Idempotency-Key
  bound to its send ids.
- Before anything is produced, every record's size is checked against its topic's
  `max.message.bytes` as the broker states it (read at start, refreshed every minute):
  `RecordTooLarge` names the record.

`publish` blocks (the SDK, the CLI); `publish_async` awaits on the caller's event loop and holds no
thread while the broker answers a single record (a transaction holds one of the pool's threads).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import socket
import threading
import time
import uuid
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient, ConfigResource

from .. import metrics
from ..errors import PublishError, PublishOutcomeUnknown
from ..kafka_client import MAX_RECORD_BYTES, client_config, durable_producer, may_be_written, produce

log = logging.getLogger("streams.publisher")
SIZES_TTL_S = 60.0
SIZES_RETRY_S = 5.0


@dataclass(frozen=True)
class Record:
    topic: str
    key: bytes
    value: bytes
    headers: tuple[tuple[str, bytes], ...] = ()

    @property
    def size(self) -> int:
        """The bytes the broker counts against max.message.bytes (value, key, headers, and a record batch's
        overhead of about 70 bytes)."""
        return len(self.value) + len(self.key) + sum(len(k) + len(v) for k, v in self.headers) + 70


@dataclass(frozen=True)
class Written:
    topic: str
    partition: int
    offset: int


class RecordTooLarge(PublishError):
    def __init__(self, index: int, size: int, limit: int, topic: str):
        super().__init__(f"record {index} is {size} bytes; {topic} accepts at most {limit}")
        self.index, self.size, self.limit, self.topic = index, size, limit, topic


@dataclass
class TopicSizes:
    """Each topic's max.message.bytes, as the broker says (cached). Only the first look at a topic waits
    for the broker (callers on an event loop make it off the loop); after that a value past SIZES_TTL_S
    is served as it is while one background read refreshes it, so a slow broker never holds a request.
    A read that fails is not tried again for SIZES_RETRY_S (until then: the last value, else the
    producer's own limit)."""

    admin: AdminClient
    sizes: dict[str, tuple[float, int]] = field(default_factory=dict)
    read_timeout_s: float = 10.0
    _refreshing: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def known(self, topic: str) -> bool:
        return topic in self.sizes

    def forget(self, topic: str) -> None:
        self.sizes.pop(topic, None)

    def limit(self, topic: str) -> int:
        cached = self.sizes.get(topic)
        if cached is None:
            return self._read(topic)
        if time.monotonic() - cached[0] > SIZES_TTL_S:
            self._refresh_in_background(topic)
        return cached[1]

    def _refresh_in_background(self, topic: str) -> None:
        with self._lock:
            if topic in self._refreshing:
                return
            self._refreshing.add(topic)
        threading.Thread(target=self._refresh, args=(topic,), name="topic-sizes", daemon=True).start()

    def _refresh(self, topic: str) -> None:
        try:
            self._read(topic)
        except PublishError as exc:  # the topic is gone: its sends fail at the broker, with its own error
            log.warning("%s", exc)
        finally:
            with self._lock:
                self._refreshing.discard(topic)

    def _read(self, topic: str) -> int:
        cached = self.sizes.get(topic)
        fallback = cached[1] if cached else MAX_RECORD_BYTES
        try:
            futures = self.admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, topic)])
            config = next(iter(futures.values())).result(timeout=self.read_timeout_s)
            size = int(config["max.message.bytes"].value)
        except KafkaException as exc:
            if exc.args[0].code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise PublishError(f"topic {topic} does not exist (`streams topics apply` creates it)") from None
            return self._failed(topic, fallback, exc)
        except Exception as exc:  # noqa: BLE001 - unknown for now: the producer's own limit still holds
            return self._failed(topic, fallback, exc)
        self.sizes[topic] = (time.monotonic(), size)
        return size

    def _failed(self, topic: str, fallback: int, exc: Exception) -> int:
        log.warning("cannot read max.message.bytes of %s (%s); assuming %d", topic, exc, fallback)
        # Looked at again in SIZES_RETRY_S (in the background), not by every request meanwhile.
        self.sizes[topic] = (time.monotonic() - SIZES_TTL_S + SIZES_RETRY_S, fallback)
        return fallback


class Publisher:
    def __init__(self, bootstrap: str, prefix: str = "", transactional: int = 4, timeout_s: float = 30.0,
                 instance: str | None = None):
        """`transactional`: producers in the pool (concurrent multi-record requests); `prefix` keeps
        transactional ids apart between namespaces. `instance`: a name this process's successor will
        have too (the bulk process's, kept by the API process that restarts it): its producers then take
        the same transactional ids, one per pool slot, and a successor's `open_pool` fences and aborts
        whatever transaction a crashed predecessor left open, at once. Without it, the ids are new per
        process, and such a transaction holds back read-committed consumers of its partitions until the
        broker times it out (transaction.timeout.ms, twice `timeout_s`)."""
        self.timeout_s = timeout_s
        self.single = durable_producer(bootstrap, **{"linger.ms": 1, "message.timeout.ms": int(timeout_s * 1000)})
        self.sizes = TopicSizes(AdminClient(client_config(bootstrap, quiet=True)))
        self._bootstrap, self._prefix = bootstrap, prefix
        self._pool: queue.Queue[Producer] = queue.Queue()
        self._pool_size = max(1, transactional)
        self._instance = instance
        self._free_slots = list(range(self._pool_size))  # slots without a producer (the last one is taken next)
        self._slot_of: dict[int, int] = {}               # id(producer) -> its slot
        self._create_lock = threading.Lock()
        self.executor = ThreadPoolExecutor(self._pool_size, thread_name_prefix="ingest-txn")
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="ingest-producer", daemon=True)
        self._poller.start()

    # ------------------------------------------------------------------ checks
    def check_sizes(self, records: list[Record]) -> None:
        for i, r in enumerate(records):
            limit = self.sizes.limit(r.topic)
            if r.size > limit:
                raise RecordTooLarge(i, r.size, limit, r.topic)

    # ------------------------------------------------------------------ publishing
    def publish(self, records: list[Record]) -> list[Written]:
        """Blocking: every record acknowledged, or none (PublishError). Nothing to publish asks nothing of the broker
        (an event no endpoint subscribes to is accepted with the broker away)."""
        if not records:
            return []
        self.check_sizes(records)
        if len(records) == 1:
            return [self._single(records[0], self.timeout_s).result(self.timeout_s + 5)]
        return self._transaction(records)

    def publish_unwaited(self, records: list[Record]) -> None:
        """Best effort, not waited for: each record on its own through the shared idempotent producer; one the
        broker does not acknowledge is logged, never raised (what must be durable goes through `publish`)."""
        for r in records:
            try:
                self._single(r, 0.0).add_done_callback(_log_failure)
            except PublishError as exc:
                log.warning("a record for %s was not published: %s", r.topic, exc)

    async def publish_async(self, records: list[Record]) -> list[Written]:
        if not records:
            return []
        loop = asyncio.get_running_loop()
        if all(self.sizes.known(r.topic) for r in records):
            self.check_sizes(records)
        else:  # a first look at a topic waits for the broker: never on the event loop
            await loop.run_in_executor(None, self.check_sizes, records)
        if len(records) == 1:
            # On the event loop: a full local queue fails the send at once rather than stall every request.
            return [await asyncio.wrap_future(self._single(records[0], 0.0))]
        return await loop.run_in_executor(self.executor, self._transaction, records)

    def _single(self, r: Record, queue_wait_s: float) -> Future[Written]:
        """Queue `r` (waiting at most `queue_wait_s` for room in a full local queue); its acknowledgement."""
        done: Future[Written] = Future()

        def on_delivery(err: KafkaError | None, msg) -> None:  # on the poll thread
            # The caller may have given up on it: asyncio.wrap_future cancels this future when the task awaiting
            # it is cancelled (a timeout around publish_async). Setting a cancelled future raises, and confluent-kafka
            # raises a callback's error out of poll(): the poll thread died, and every later send waited for good.
            try:
                if err is not None and may_be_written(err):
                    done.set_exception(PublishOutcomeUnknown(f"{r.topic} did not acknowledge the send; it may have "
                                                             f"been written: {err.str()}"))
                elif err is not None and err.code() == KafkaError.MSG_SIZE_TOO_LARGE:
                    # The topic's limit was lowered since it was read. The broker refuses the producer's whole
                    # batch, small sends with the large one: a retry is checked against the limit read again.
                    self.sizes.forget(r.topic)
                    done.set_exception(PublishError(f"{r.topic} refused the send's batch as too large: {err.str()}"))
                elif err is not None:
                    done.set_exception(PublishError(f"{r.topic} did not acknowledge the send: {err.str()}"))
                else:
                    done.set_result(Written(msg.topic(), msg.partition(), msg.offset()))
            except InvalidStateError:
                if err is None:
                    log.info("a send to %s was acknowledged after its caller stopped waiting", r.topic)
                else:
                    log.warning("a send to %s whose caller stopped waiting was not acknowledged: %s", r.topic,
                                err.str())

        try:
            produce(self.single, r.topic, r.value, key=r.key, headers=r.headers, on_delivery=on_delivery,
                    timeout_s=queue_wait_s)
        except KafkaException as exc:
            raise PublishError(f"cannot publish to {r.topic}: {exc}") from None
        return done

    def _poll(self) -> None:
        """Serve the single-record producer's delivery reports until closed; no error ends it (every single
        send of this process waits on it)."""
        while not self._stop.is_set():
            try:
                self.single.poll(0.05)
            except Exception:  # noqa: BLE001 - logged; the next report must still be served
                log.exception("a delivery report of the ingest producer failed")

    def _transaction(self, records: list[Record]) -> list[Written]:
        producer = self._borrow()
        written: list[Written | None] = [None] * len(records)
        failures: list[str] = []
        started = time.monotonic()
        committing = False
        try:
            producer.begin_transaction()
            for i, r in enumerate(records):
                def on_delivery(err: KafkaError | None, msg, i: int = i, topic: str = r.topic) -> None:
                    if err is not None:
                        failures.append(err.str())
                        if err.code() == KafkaError.MSG_SIZE_TOO_LARGE:  # as for a single send (`_single`)
                            self.sizes.forget(topic)
                    else:
                        written[i] = Written(msg.topic(), msg.partition(), msg.offset())

                produce(producer, r.topic, r.value, key=r.key, headers=r.headers, on_delivery=on_delivery,
                        timeout_s=max(0.0, started + self.timeout_s - time.monotonic()))  # one wait per batch
            committing = True
            self._commit(producer)
        except KafkaException as exc:
            error: KafkaError = exc.args[0]
            if not self._abort(producer, error) and committing:
                # The commit was asked and not aborted: the coordinator may still complete it.
                raise PublishOutcomeUnknown(f"the batch's commit did not finish and could not be aborted; it may "
                                            f"have been published: {error.str()}") from None
            raise PublishError(f"the batch was not published (nothing of it was): {error.str()}") from None
        else:
            self._return(producer)
        metrics.INGEST_TRANSACTION_SECONDS.observe(time.monotonic() - started)
        if failures or any(w is None for w in written):  # cannot happen after a commit; never pretend
            raise PublishOutcomeUnknown(f"the broker reported failures in a committed batch: {failures[:3]}")
        return [w for w in written if w is not None]

    def _commit(self, producer: Producer) -> None:
        """Commit; a commit that timed out is still under way and is asked again (librdkafka's rule),
        until it succeeds or fails for good (then it is aborted: nothing of it is ever read)."""
        deadline = time.monotonic() + 2 * self.timeout_s
        while True:
            try:
                producer.commit_transaction(max(1.0, deadline - time.monotonic()))
                return
            except KafkaException as exc:
                error: KafkaError = exc.args[0]
                if not error.retriable() or error.txn_requires_abort() or time.monotonic() >= deadline:
                    raise

    def open_pool(self) -> None:
        """Start every transactional producer of the pool now (with `instance`: fencing a predecessor's)."""
        while (producer := self._create()) is not None:
            self._return(producer)

    def _borrow(self) -> Producer:
        try:
            return self._pool.get_nowait()
        except queue.Empty:
            pass
        producer = self._create()
        return self._pool.get() if producer is None else producer

    def _create(self) -> Producer | None:
        """A new transactional producer in a free slot; None when every slot has one."""
        with self._create_lock:
            if not self._free_slots:
                return None
            slot = self._free_slots.pop()
        try:
            producer = self._new_transactional(slot)
        except PublishError:
            with self._create_lock:
                self._free_slots.append(slot)
            raise
        with self._create_lock:
            self._slot_of[id(producer)] = slot
        return producer

    def _new_transactional(self, slot: int) -> Producer:
        instance = self._instance or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        txn_id = f"{self._prefix}ingest-{instance}-{slot}"
        producer = durable_producer(self._bootstrap, **{"transactional.id": txn_id, "linger.ms": 1,
                                                        "transaction.timeout.ms": int(self.timeout_s * 2000)})
        try:
            producer.init_transactions(self.timeout_s)
        except KafkaException as exc:
            raise PublishError(f"cannot start a producer transaction: {exc.args[0].str()}") from None
        return producer

    def _return(self, producer: Producer) -> None:
        self._pool.put(producer)

    def _abort(self, producer: Producer, error: KafkaError) -> bool:
        """Abort (True once aborted); a producer that cannot abort (a fatal error) is replaced by a new
        one later."""
        if not error.fatal():
            try:
                producer.abort_transaction(self.timeout_s)
                self._return(producer)
                return True
            except KafkaException as exc:
                log.warning("aborting a transaction failed (%s); replacing the producer", exc.args[0].str())
        with self._create_lock:
            self._free_slots.append(self._slot_of.pop(id(producer)))
        return False

    def close(self) -> None:
        self._stop.set()
        self._poller.join(2)
        self.single.flush(self.timeout_s)
        self.executor.shutdown(wait=True)
        while not self._pool.empty():
            self._pool.get_nowait().flush(5)


def _log_failure(done: Future[Written]) -> None:
    exc = done.exception()
    if exc is not None:
        log.warning("a record published without waiting was not acknowledged: %s", exc)
