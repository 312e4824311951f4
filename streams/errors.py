"""Every error this project raises on purpose. Adapters translate library errors (confluent-kafka,
redis-py, httpx) into these at the boundary, so callers handle one tree:

    DispatchError
    ├── ConfigError              a setting or definition file is invalid (names the variable / file / field)
    ├── StackError               the local Kafka/Redis stack could not be started or reached
    ├── TopicPlanError           a topic change that must not be applied (e.g. fewer partitions)
    ├── SendValidationError      a send (or a batch) is invalid; carries field-level errors
    │   ├── PayloadError         the payload does not fit its channel (also a ValueError, for pydantic)
    │   └── SendTooLarge         a send over the documented maximum size (refused before anything is produced)
    ├── MalformedEvent           an event on a topic that cannot be dispatched; `reason` goes to the DLQ
    ├── PublishError             the broker did not acknowledge every send of a publish (none was written)
    │   └── PublishOutcomeUnknown   the broker did not confirm a publish in time and may still write it
    │       └── ReplayOutcomeUnknown   ... a replay's: it may have been published under its new send id
    ├── BrokerUnavailable        the broker did not answer a read in time (nothing is taken as gone)
    ├── ReplayRefused            a dead letter that cannot be replayed; the message says why
    │   └── ReplayNotYet         ... until something changes (checked with the provider, a batch settled)
    │       └── ReplayNeedsCheck ... until the operator checked the provider does not hold it
    ├── StoreUnavailable         Redis did not answer: callers hold and retry, never skip
    │   └── GateUnavailable      ... while admitting a request: the gate fails closed
    ├── GateError
    │   └── CostExceedsBurst     a cost larger than a bucket's burst can never be admitted
    └── ProviderError            a provider call did not deliver
        ├── ForbiddenProviderPath   a request to a path outside the allowlist (never sent)
        └── ProviderAuthError       no usable token from the provider's token endpoint
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .send import Send


class DispatchError(Exception):
    """Base of every error this project raises on purpose."""


class ConfigError(DispatchError):
    """Invalid configuration; the message names where (variable, file, topic, field)."""


class StackError(DispatchError):
    """The local stack could not be started, reached or stopped."""


class TopicPlanError(DispatchError):
    """A topic change that is refused (for example decreasing partitions)."""


def format_field_errors(errors: Sequence[Any]) -> str:
    """`a.b: message; c: message` from [{loc, msg}] (pydantic's error shape)."""
    return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors)


class SendValidationError(DispatchError):
    """A send or a batch failed validation. `errors` lists {loc, msg} per field."""

    def __init__(self, errors: list[dict]):
        self.errors = errors
        super().__init__(format_field_errors(errors))


class PayloadError(SendValidationError, ValueError):
    """The payload does not fit its channel. Raised inside a pydantic validator (hence ValueError);
    its errors are the payload's own, under `payload.<field>`."""


class MalformedEvent(DispatchError):
    """An event on a topic that cannot be dispatched. `reason` goes to the DLQ header. `send`: the event read as a
    send (a `Send`) when only its payload is refused, so that its status can say it was dead-lettered."""

    def __init__(self, reason: str, detail: str, send: Send | None = None):
        self.reason = reason
        self.detail = detail
        self.send = send
        super().__init__(f"{reason}: {detail}")


class PublishError(DispatchError):
    """The broker did not acknowledge every send; none was written (PublishOutcomeUnknown: maybe all were)."""


class BrokerUnavailable(DispatchError):
    """The broker did not answer a read in time: what was asked for may well exist (retry later)."""


class ReplayRefused(DispatchError):
    """A dead letter that cannot be replayed; the message says why."""


class ReplayNotYet(ReplayRefused):
    """Refused for now, not for good: asked again later (or as the message says), it may be replayed."""


class ReplayNeedsCheck(ReplayNotYet):
    """Refused until the operator says they checked the provider (a send dead-lettered `unknown_outcome`)."""


class StoreUnavailable(DispatchError):
    """Redis did not answer (connection refused, timeout, a script error). Nothing was decided:
    the caller holds the work and tries again later."""


class StoreWriteUnknown(StoreUnavailable):
    """A write Redis did not answer: made (its answer lost) or not, nobody can say (an operator change through
    the operator log: `write_through_log`)."""


class StateLost(StoreUnavailable):
    """Redis answered but holds no epoch: its data was lost (restarted empty, flushed, failed over to
    an empty replica). Nothing may be claimed until the state guard has looked."""


class LimitOutOfRange(ConfigError):
    """A limit Redis holds (edited by hand past `streams limits set`) with a rate not above 0 or a burst below 1:
    refused, never taken as no limit."""


class GateError(DispatchError):
    """The bucket gate could not admit a request."""


class GateUnavailable(StoreUnavailable, GateError):
    """Redis is unreachable while admitting a request. The gate fails closed: no provider call."""


class BucketUnreadable(GateUnavailable):
    """One request's buckets are held by Redis in a shape the gate's script cannot read (a key of another type, a
    field missing): that request fails alone, not every request of its round."""


class CostExceedsBurst(GateError):
    """The requested cost is larger than a bucket's burst; waiting would never help."""


class ProviderError(DispatchError):
    """A provider call did not deliver."""


class ForbiddenProviderPath(ProviderError):
    """A request to a provider path outside the allowlist. It is never sent."""


class ProviderAuthError(ProviderError):
    """No usable token: the token endpoint could not be reached, refused us, or stated no expiry."""


class PublishOutcomeUnknown(PublishError):
    """The broker did not confirm a publish and may have written it or still write it: a batch's commit
    was asked and neither finished nor could be aborted, or a single record's delivery failed with an
    error other than a refusal (a timeout, a lost connection: it may have reached the broker). The
    caller retries with the same Idempotency-Key, under which its sends keep their ids and are sent
    at most once."""


class ReplayOutcomeUnknown(PublishOutcomeUnknown):
    """A replay the broker did not confirm: it may have been published as `replay_id` (look it up before
    replaying again: a second replay is another send id, which nothing deduplicates)."""

    def __init__(self, message: str, replay_id: str):
        super().__init__(message)
        self.replay_id = replay_id


class SendTooLarge(SendValidationError):
    """A send larger than the maximum a send may be; nothing of its request was produced. Invalid, not a publish
    that failed: the same send is refused however often it is published again (a PublishError may be retried)."""

    def __init__(self, index: int, size: int, limit: int | None = None):
        from .send import MAX_SEND_BYTES

        self.index, self.size, self.limit = index, size, limit or MAX_SEND_BYTES
        sizes = f"{size} bytes; a send may be at most {self.limit} bytes"
        self.errors = [{"loc": (index,), "msg": f"the send is {sizes}"}]
        DispatchError.__init__(self, f"send {index} is {sizes}")


class AuditUnconfirmed(DispatchError):
    """An operator change made from the CLI was applied (and its result printed), but the broker did not
    confirm its record on the audit trail. The `streams` command exits 4 for it, not 1: nothing failed to
    apply, and running the command again would make a second change where one cannot be repeated."""
