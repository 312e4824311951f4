"""Per-tenant queues inside a lane worker. Pure code; time is passed in.

Messages wait in one queue per tenant, so a tenant whose bucket is empty waits alone while other
tenants sharing its partitions keep moving (no head-of-line blocking). A queue is *ready* when
its own hold has passed (a hold of the provider account a queue sends under is the dispatcher's, per
route). The FIFO baseline of the benchmarks
puts every message in one queue (an injected `queue_key`), which is exactly the naive design.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..send import Send

Offset = tuple[str, int, int]  # topic, partition, offset
# The most bytes of messages one request takes (a message larger goes alone): each request's body is stored in Redis
# before it is sent (kept a day when its outcome is unknown), and 100 sends of 1 MiB in one request put 100 MB through
# Redis's single thread, which every worker's gate waits on.
REQUEST_BYTES = 4 * 1024 * 1024


@dataclass
class Pending:
    """One message taken from a lane topic, until its outcome is durable (delivered and recorded,
    or copied to a retry tier or the DLQ)."""

    topic: str
    partition: int
    offset: int
    raw: bytes = field(repr=False)  # the event's bytes, re-published unchanged to retry tiers and the DLQ
    headers: dict[str, bytes]
    send: Send = field(repr=False)  # its payload holds the recipient and the message
    attempt: int
    provider: str = ""         # a fallback copy names the provider it goes to ("": the channel's first)
    consumed_at_ms: float = 0.0  # when the consumer returned it (stage timings)
    held_since_ms: int = 0     # its first short 429 of this attempt, waited out in the worker (0: none)
    alone: bool = False        # its batch was refused for its size: sent in a request of its own
    declined: int = 0          # of its earlier attempts, those a provider declined with a 429 (the `declined` header)

    @property
    def where(self) -> Offset:
        return (self.topic, self.partition, self.offset)


@dataclass
class TenantQueue:
    items: deque[Pending] = field(default_factory=deque)
    ready_at: float = 0.0
    dry_until: float = 0.0  # its bucket's next token, as the gate last said (a hold may end sooner)


def by_tenant(send: Send) -> str:
    return send.tenant_id


def by_endpoint(send: Send) -> str:
    """Webhook deliveries queue per endpoint: a slow receiver waits alone, like a throttled tenant."""
    return str(send.payload.get("endpoint_id"))


class TenantQueues:
    def __init__(self, queue_key: Callable[[Send], str] = by_tenant,
                 owned: Callable[[tuple[str, int]], bool] = lambda partition: True):
        """`owned`: whether this consumer still owns a (topic, partition); what is put back of one it no longer
        owns is dropped."""
        self.queue_key = queue_key
        self.owned = owned
        self.queues: dict[str, TenantQueue] = {}
        self.buffered = 0
        self.buffered_bytes = 0  # what the queued messages' events weigh (held twice: bytes and decoded)
        # Queued messages by the bucket they are sent under (tenant, provider), over all the tenant's queues (a
        # webhook tenant has one an endpoint): what its share of the buffer is measured against.
        self.of_bucket: Counter[tuple[str, str]] = Counter()

    def key_of(self, p: Pending) -> str:
        """A message's queue: its tenant's (its endpoint's), apart for a fallback provider's messages
        (a request goes to one provider)."""
        key = self.queue_key(p.send)
        return f"{key}@{p.provider}" if p.provider else key

    def add(self, p: Pending) -> None:
        self.queues.setdefault(self.key_of(p), TenantQueue()).items.append(p)
        self.buffered += 1
        self.buffered_bytes += len(p.raw)
        self.of_bucket[(p.send.tenant_id, p.provider)] += 1

    def ready(self, now: float) -> list[str]:
        """Queues with work whose holds have passed. An empty queue whose hold has passed is dropped here: a worker
        meets every tenant (every endpoint) it ever served, and scanning all of them every step, and keeping them,
        grew its step and its memory for as long as it ran (an empty queue still held, or whose bucket is still dry,
        is kept: a receiver's Retry-After applies to the next delivery too)."""
        ready, gone = [], []
        for k, q in self.queues.items():  # one pass a step: this runs with every dispatch
            if q.items:
                if q.ready_at <= now:
                    ready.append(k)
            elif max(q.ready_at, q.dry_until) <= now:
                gone.append(k)
        for k in gone:
            del self.queues[k]
        return ready

    def next_ready(self, now: float, paced_until: float = 0.0) -> float | None:
        """When the next queue with work becomes ready (None: no work at all). `paced_until`: the end of the
        provider's pause between waves, which a queue ready now waits for; a queue held until sooner is asked then."""
        waits = [q.ready_at if q.ready_at > now else paced_until for q in self.queues.values() if q.items]
        if not waits:
            return None
        return max(min(waits), now)

    def size(self, key: str) -> int:
        q = self.queues.get(key)
        return len(q.items) if q else 0

    def head_tenant(self, key: str) -> str:
        return self.queues[key].items[0].send.tenant_id

    def head_provider(self, key: str) -> str:
        return self.queues[key].items[0].provider

    def take(self, key: str, n: int) -> list[Pending]:
        """Up to n messages from the head of a queue, all of one tenant (one API key per request), of at most
        REQUEST_BYTES together unless one alone is larger; a message to be sent alone in a request of its own."""
        q = self.queues[key]
        tenant = q.items[0].send.tenant_id
        taken: list[Pending] = []
        size = 0
        while q.items and len(taken) < n and q.items[0].send.tenant_id == tenant:
            head = q.items[0]
            if taken and (taken[0].alone or head.alone or size + len(head.raw) > REQUEST_BYTES):
                break
            size += len(head.raw)
            taken.append(q.items.popleft())
        self._removed(taken)
        return taken

    def take_newest(self, key: str, n: int) -> list[Pending]:
        """Up to n messages from the tail of a queue (the last to arrive), in their order."""
        q = self.queues.get(key)
        if q is None or n <= 0:
            return []
        taken = [q.items.pop() for _ in range(min(n, len(q.items)))]
        taken.reverse()
        self._removed(taken)
        return taken

    def put_back(self, key: str, items: list[Pending], hold_until: float | None = None) -> None:
        """Return messages to the front of their queue, in their order; optionally hold the queue. Messages of a
        partition revoked (or lost) while their request was out are not returned: its new owner reads them again,
        and dispatching them here too would start a second retry chain for each."""
        items = [p for p in items if self.owned((p.topic, p.partition))]
        q = self.queues.setdefault(key, TenantQueue())
        q.items.extendleft(reversed(items))
        self.buffered += len(items)
        self.buffered_bytes += sum(len(p.raw) for p in items)
        self.of_bucket.update((p.send.tenant_id, p.provider) for p in items)
        if hold_until is not None:
            q.ready_at = hold_until

    def hold(self, key: str, until: float) -> None:
        self.queues.setdefault(key, TenantQueue()).ready_at = until

    def splice(self, key: str, send_ids: Iterable[str]) -> list[Pending]:
        """Remove and return the queued messages of these sends (they settle with a recovered request)."""
        wanted = set(send_ids)
        q = self.queues.get(key)
        if q is None:
            return []
        out = [p for p in q.items if p.send.send_id in wanted]
        if out:
            q.items = deque(p for p in q.items if p.send.send_id not in wanted)
            self._removed(out)
        return out

    def forget(self, partitions: set[tuple[str, int]]) -> None:
        """Drop the messages of revoked partitions (their new owner reads them again)."""
        for q in self.queues.values():
            self._removed([p for p in q.items if (p.topic, p.partition) in partitions])
            q.items = deque(p for p in q.items if (p.topic, p.partition) not in partitions)

    def _removed(self, items: list[Pending]) -> None:
        self.buffered -= len(items)
        self.buffered_bytes -= sum(len(p.raw) for p in items)
        for p in items:
            bucket = (p.send.tenant_id, p.provider)
            self.of_bucket[bucket] -= 1
            if not self.of_bucket[bucket]:
                del self.of_bucket[bucket]  # not kept for every tenant ever served


def unique_sends(items: list[Pending]) -> tuple[list[Pending], list[Pending]]:
    """Split a request's messages into one per send id and the duplicates (the same job twice). Of two copies
    of one send, the one for the later attempt is kept: the earlier one may be stale (read again after its
    attempt failed), and the later one is the send's live retry."""
    unique: dict[str, Pending] = {}
    duplicates = []
    for p in items:
        kept = unique.get(p.send.send_id)
        if kept is None:
            unique[p.send.send_id] = p
        elif p.attempt > kept.attempt:
            duplicates.append(kept)
            unique[p.send.send_id] = p
        else:
            duplicates.append(p)
    return list(unique.values()), duplicates
