"""dual-rail dispatch: multi-tenant notification dispatch on Apache Kafka.

The public API for producers is `SendClient` (`from streams import SendClient`) and the errors it
raises. Imports are lazy, so the pure modules of the package load without Kafka or Redis clients.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["SendClient", "DispatchError", "ConfigError", "PublishError", "SendValidationError"]

if TYPE_CHECKING:
    from .errors import ConfigError, DispatchError, PublishError, SendValidationError
    from .ingest.sdk import SendClient


def __getattr__(name: str) -> Any:
    if name == "SendClient":
        from .ingest.sdk import SendClient

        return SendClient
    if name in ("DispatchError", "ConfigError", "PublishError", "SendValidationError"):
        from . import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'streams' has no attribute {name!r}")
