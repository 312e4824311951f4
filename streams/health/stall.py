"""When the endpoint-health app must read a partition again: the policy, without I/O. Two cases, one
cause: faust-streaming drops records it has fetched when its flow stops or the group's generation
changes in the middle of handing them over, and its position is then past them.

1. An attempts partition (`StallWatch`).

faust-streaming can lose the records it fetched in the moment a rebalance's recovery completes
(it resumes the partitions, fetches, then clears its queues as it resumes its flow): the agent never
sees them, and faust's position is past them. Seen after a kill -9 and a restart. When nothing more
arrives on that partition, the group's committed offset stays below the partition's end for good,
and the copy silently stops counting for the partition's endpoints.

`StallWatch` recognises that state from what the broker says (the group's committed offset and the
partition's end) and what the agent did (events taken from the partition, an event in hand): a
partition is stalled when, at two checks in a row, it had records past its committed offset, that
offset had not moved, the agent took no event from it in between and held none at either check. It
is then read again from its committed offset; an event read twice changes nothing (the table row
remembers the offset it applied). A partition is read again from one offset once per rebalance: if
its committed offset stays there (e.g. nothing but a transaction marker lies past it, which no event
acknowledges), reading again would not change that.

Not covered: when the next record on that partition arrives first, the lost ones are not applied
(faust takes their offsets as done, or they come again only after later events of their endpoint,
which the row's offset check then ignores). Seeking back from
inside the agent was tried and dropped: a batch faust's fetcher is still delivering can undo the
seek, and the partition would then be skipped until the next rebalance.

2. A changelog partition being recovered (`RecoveryWatch`). Seen when a copy held a partition's
changelog as a standby and then, after the other copy died, took it over: recovery read the
changelog again from its start, the records were fetched (the position reached the end) and never
applied, and recovery waited for them for good, the copy applying no attempt event at all.
A partition whose recovery applied nothing more at two checks in a row, while the position is past
the partition's last record, is read again from the record after the last one applied; it is then
given two more checks before it can be read again. A record recovered twice changes nothing (the
row holds the latest value)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

P = TypeVar("P", bound=Hashable)


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


@dataclass
class RecoveryWatch:
    _generation: int | None = None
    _applied: dict[Hashable, int] = field(default_factory=dict)  # partition -> last offset recovered, last check

    def observe(self, generation: int, recovering: Mapping[P, tuple[int, int, int]]) -> dict[P, int]:
        """`recovering`: each active changelog partition recovery still waits for (any key naming it)
        -> (the last offset it applied, -1 for none; the partition's last offset; the consumer's
        position, the next offset it will fetch). Returns the partitions to read again -> the offset
        to read them from (call `reread` once that is done)."""
        if generation != self._generation:
            self._generation, self._applied = generation, {}
        fetched_all: dict[Hashable, int] = {p: applied for p, (applied, last, position) in recovering.items()
                                            if applied < last < position}
        stuck = {p: applied + 1 for p, (applied, _, _) in recovering.items() if p in fetched_all
                 and self._applied.get(p) == applied}
        self._applied = fetched_all
        return stuck

    def reread(self, partition: Hashable) -> None:
        self._applied.pop(partition, None)

    def forget(self) -> None:
        """Start over (no recovery going on, or faust could not say)."""
        self._applied = {}
