"""Per-tenant quotas at ingest, from the same primitives as the dispatch gate: the same Lua token
buckets, set by operators the same way (`streams limits set`, `PUT /v1/admin/limits/{provider}`),
under these names:

    ingest-requests        a tenant's requests per second (the tenant bucket: one per request)
    ingest-transactional   a tenant's transactional and product sends per second
    ingest-marketing       a tenant's marketing sends per second

Each needs its global limit too (set it high: quotas are per tenant); a tenant quota is refused
while its global limit is missing, which would leave it unenforced. A quota nobody has set is not
enforced. Over a quota, the request is refused whole with 429 and Retry-After (nothing is
published); a request larger than the tenant's burst can never pass and gets 422.

The transactional quota is the ceiling that keeps one tenant from holding the transactional lane
above the yield threshold by itself (every tenant's marketing would then wait): set it below what
the channel's provider dispatches per second (`streams limits show --provider resend`), e.g. half.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

from ..errors import ConfigError, CostExceedsBurst, GateError, LimitOutOfRange
from ..gate.gate import Gate
from ..send import Send

REQUESTS = "ingest-requests"
QUOTAS = (REQUESTS, "ingest-transactional", "ingest-marketing")
log = logging.getLogger("streams.ingest")


def lane_quota(lane: str) -> str:
    return f"ingest-{lane}"


@dataclass(frozen=True)
class OverQuota:
    quota: str
    retry_after_s: float
    shared: bool = False  # the quota's global bucket ran out (every tenant's), not the tenant's own

    def __str__(self) -> str:
        whose = "the platform-wide limit of the" if self.shared else "over the"
        return f"{whose} {self.quota} quota: retry after {self.retry_after_s:.1f} s"

    @property
    def retry_after(self) -> str:
        """The Retry-After header: whole seconds, never 0."""
        return str(max(1, round(self.retry_after_s + 0.5)))


@dataclass(frozen=True)
class BeyondBurst:
    quota: str
    cost: int
    message: str


class IngestQuotas:
    def __init__(self, gate: Gate):
        self.gate = gate

    @staticmethod
    def _checks(tenant: str, sends: list[Send], request: bool = True) -> list[tuple[str, str, int, bool]]:
        per_lane = Counter(s.lane for s in sends)
        return ([(REQUESTS, tenant, 1, False)] if request else []) + [
            (lane_quota(lane), tenant, n, False) for lane, n in per_lane.items()]

    def give_back_request(self, tenant: str, sends: list[Send], request: bool = True) -> None:
        """An admitted request that then published nothing (the broker refused it): charged nothing."""
        self.give_back([(quota, tenant, cost) for quota, _, cost, _ in self._checks(tenant, sends, request)])

    def admit(self, tenant: str, sends: list[Send], request: bool = True) -> OverQuota | BeyondBurst | None:
        """None: within every quota that is set (the buckets are debited). A request refused by one quota is
        charged by none: what the others took is given back (a tenant retrying a batch over its marketing quota
        must not use up its transactional one). Without `request`, only the sends' lanes are charged (the sends
        a bulk replay publishes one by one, its request charged once)."""
        checks = self._checks(tenant, sends, request)
        taken: list[tuple[str, str, int]] = []
        refusal: OverQuota | BeyondBurst | GateError | LimitOutOfRange | None = None
        for (quota, _, cost, _), answer in zip(checks, self.gate.acquire_many(checks), strict=True):
            if isinstance(answer, CostExceedsBurst):
                refusal = refusal or BeyondBurst(quota, cost, str(answer))
            elif isinstance(answer, LimitOutOfRange):  # set, but to 0 or below by hand: refused, not lifted
                refusal = refusal or answer
            elif isinstance(answer, ConfigError):
                continue  # nobody set this quota: not enforced
            elif isinstance(answer, GateError):
                refusal = refusal or answer
            elif not answer.allowed:
                refusal = refusal or OverQuota(quota, answer.wait_s, answer.short == "global")
            else:
                taken.append((quota, tenant, cost))
        if refusal is None:
            return None
        self.give_back(taken)
        if isinstance(refusal, (GateError, LimitOutOfRange)):
            raise refusal
        return refusal

    def give_back(self, taken: list[tuple[str, str, int]]) -> None:
        """Best effort: Redis failing here leaves the tokens spent (they refill), never fails the answer."""
        try:
            self.gate.refund_many(taken)
        except GateError as exc:
            log.warning("could not give back %d quota admissions: %s", len(taken), exc)
