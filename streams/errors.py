"""The project's error tree. Adapters translate library errors into these at the boundary.

    DispatchError
    ├── ConfigError             a setting or definition file is invalid (names file / field)
    ├── StackError              the local Kafka/Redis stack could not be started or reached
    ├── TopicPlanError          a topic change that must not be applied (e.g. fewer partitions)
    ├── SendValidationError     a send (or a batch) is invalid; carries field-level errors
    ├── GateError
    │   ├── GateUnavailable     Redis unreachable: the gate fails closed
    │   └── CostExceedsBurst    a cost larger than a bucket's burst can never be admitted
    └── ProviderError           a provider call did not deliver
        ├── ForbiddenProviderPath   a request to a path outside the allowlist (never sent)
        └── ProviderAnswer          the provider answered (or not): status, kind, retry-after
"""

from __future__ import annotations


class DispatchError(Exception):
    """Base of every error this project raises on purpose."""


class ConfigError(DispatchError):
    """Invalid configuration; the message names where (file, topic, field)."""


class StackError(DispatchError):
    """The local stack could not be started, reached or stopped."""


class TopicPlanError(DispatchError):
    """A topic change that is refused (for example decreasing partitions)."""


class SendValidationError(DispatchError):
    """A send or a batch failed validation. `errors` lists {loc, msg} per field."""

    def __init__(self, errors: list[dict]):
        self.errors = errors
        super().__init__("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors))


class GateError(DispatchError):
    """The bucket gate could not answer."""


class GateUnavailable(GateError):
    """Redis is unreachable. The gate fails closed: no provider call is made."""


class CostExceedsBurst(GateError):
    """The requested cost is larger than a bucket's burst; waiting would never help."""


class ProviderError(DispatchError):
    """A provider call did not deliver."""


class ForbiddenProviderPath(ProviderError):
    """A request to a provider path outside the allowlist. It is never sent."""
