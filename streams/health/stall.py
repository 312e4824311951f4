"""When the endpoint-health app must read a partition again: the policy, without I/O.

faust-streaming can lose the records it fetched in the moment a rebalance's recovery completes
(it resumes the partitions, fetches, then clears its queues as it resumes its flow): the agent never
sees them, and faust's position is past them. Seen after a kill -9 and a restart. Two things follow,
and each has its watch here:

- nothing more arrives on that partition: the group's committed offset stays below the partition's
  end for good. `StallWatch` recognises that from what the broker says (committed offset, end) and
  what the agent did (events taken from the partition, an event in hand);
- the next record arrives: it is the first the agent sees from that partition since the
  rebalance, and it lies past the committed offset. `FirstEvents` recognises that; the records
  between were lost, and faust would commit past them.

Either way the partition is read again from its committed offset. An event read twice changes
nothing (the table row remembers the offset it applied). A partition is read again from one offset
once per rebalance: if its committed offset stays there (e.g. nothing but a transaction marker lies
past it, which no event acknowledges), reading again would not change that."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


@dataclass
class StallWatch:
    _generation: int | None = None
    _behind: dict[int, int] = field(default_factory=dict)  # partition -> committed offset, at the last check
    _taken: dict[int, int] = field(default_factory=dict)   # partition -> events taken from it, at the last check
    _reread: set[tuple[int, int]] = field(default_factory=set)  # (partition, offset) read again this generation

    def observe(self, generation: int, taken: dict[int, int], busy: bool,
                behind: dict[int, int]) -> dict[int, int]:
        """`generation`: the consumer group generation (a rebalance starts the watch over); `taken`:
        events the agent has taken so far, per partition; `busy`: it held an event at some moment of
        this check (sampled before and after the broker was asked); `behind`: each assigned partition
        with records past its committed offset -> that offset. Returns the partitions to read again ->
        the offset to read them from (call `reread` once that is done)."""
        if generation != self._generation:
            self._generation, self._behind, self._taken, self._reread = generation, {}, {}, set()
        stalled = {} if busy else {
            p: offset for p, offset in behind.items()
            if self._behind.get(p) == offset and taken.get(p, 0) == self._taken.get(p, 0)
            and (p, offset) not in self._reread}
        self._taken = dict(taken)
        self._behind = {p: offset for p, offset in behind.items() if not busy}
        return stalled

    def reread(self, partition: int, offset: int) -> None:
        self._reread.add((partition, offset))

    def forget(self) -> None:
        """Start over (the broker could not say)."""
        self._behind, self._taken = {}, {}


class Verdict(Enum):
    APPLY = "apply"    # the event is the next one: apply it
    CHECK = "check"    # the first from its partition since the rebalance: ask for the committed offset
    REREAD = "reread"  # records before it were lost: read the partition again from the committed offset
    SKIP = "skip"      # the partition is being read again: this event comes again in its turn


@dataclass
class FirstEvents:
    """After each rebalance, the first event the agent takes from a partition must be the one at the
    group's committed offset. One past it means faust lost what lay between; the partition is then
    read again from the committed offset, and the events still queued after the one that showed the
    loss are skipped until the partition's events come again from there (applying them first would
    put them before the lost ones, and the row's offset check would then ignore those)."""

    _generation: int | None = None
    _checked: set[int] = field(default_factory=set)
    _rereading: dict[int, int] = field(default_factory=dict)    # partition -> the offset that showed the loss
    _reread: set[tuple[int, int]] = field(default_factory=set)  # (partition, offset) read again this generation

    def take(self, generation: int, partition: int, offset: int, committed: int | None = None) -> Verdict:
        """`committed`: the group's committed offset of `partition`, once a CHECK asked for it."""
        if generation != self._generation:
            self._generation, self._checked, self._rereading, self._reread = generation, set(), {}, set()
        seen = self._rereading.get(partition)
        if seen is not None:
            if offset > seen:  # still queued from before the seek; read again, it comes after
                return Verdict.SKIP
            del self._rereading[partition]  # read again from the committed offset (or the earliest kept)
            return Verdict.APPLY
        if partition in self._checked:
            return Verdict.APPLY
        if committed is None:
            return Verdict.CHECK
        self._checked.add(partition)
        if offset > committed and (partition, committed) not in self._reread:
            self._reread.add((partition, committed))
            self._rereading[partition] = offset
            return Verdict.REREAD
        return Verdict.APPLY

    def abandon(self, partition: int) -> None:
        """The partition could not be read again (e.g. revoked meanwhile): take its events as they come."""
        self._rereading.pop(partition, None)
