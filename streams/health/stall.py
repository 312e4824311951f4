"""When the endpoint-health app must read a partition again: the policy, without I/O.

faust-streaming can lose the records it fetched in the moment a rebalance's recovery completes
(it resumes the partitions, fetches, then clears its queues as it resumes its flow): the agent never
sees them, the group's committed offset stays below the partition's end, and nothing more arrives
until the next event (the lost one is then never applied). Seen after a kill -9 and a restart.

`StallWatch` recognises that state from what the broker says (the group's committed offset and the
partition's end) and what the agent did (events taken): a partition is stalled when, at two checks
in a row, it had records past its committed offset, that offset had not moved, and the agent took no
event and had none in hand in between. It is then read again from its committed offset; an event
read twice changes nothing (the table row remembers the offset it applied). A partition is read
again from one offset once: if its committed offset stays there (e.g. nothing but a transaction
marker lies past it, which no event acknowledges), reading again would not change that."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StallWatch:
    _behind: dict[int, int] = field(default_factory=dict)  # partition -> committed offset, at the last check
    _taken: int = -1                                        # events the agent had taken, at the last check
    _reread: dict[int, int] = field(default_factory=dict)   # partition -> the offset it was last read again from

    def observe(self, taken: int, busy: bool, behind: dict[int, int]) -> dict[int, int]:
        """`taken`: events the agent has taken so far; `busy`: it holds one now; `behind`: each assigned
        partition with records past its committed offset -> that offset. Returns the partitions to read
        again -> the offset to read them from (once per partition and offset)."""
        idle = not busy and taken == self._taken
        stalled = {p: offset for p, offset in behind.items()
                   if idle and self._behind.get(p) == offset and self._reread.get(p) != offset}
        self._reread.update(stalled)
        self._taken = taken
        self._behind = {p: offset for p, offset in behind.items() if p not in stalled}
        return stalled

    def forget(self) -> None:
        """Start over (a rebalance moved the partitions, or the broker could not say)."""
        self._behind, self._taken, self._reread = {}, -1, {}
