"""Process settings read from the environment (`from_env`), validated with clear errors."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from .errors import ConfigError

DEFAULT_KAFKA_PORT = 19092
DEFAULT_REDIS_PORT = 16379


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


@dataclass(frozen=True)
class StackSettings:
    """Where the stack lives. Explicit addresses win over the local stack."""

    home: Path
    kafka_bootstrap: str | None
    redis_url: str | None
    kafka_port: int
    redis_port: int

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "StackSettings":
        home = Path(environ.get("DUAL_RAIL_HOME") or Path.home() / ".cache" / "dual-rail")
        return cls(
            home=home,
            kafka_bootstrap=environ.get("KAFKA_BOOTSTRAP_SERVERS") or None,
            redis_url=environ.get("REDIS_URL") or None,
            kafka_port=_int(environ, "DUAL_RAIL_KAFKA_PORT", DEFAULT_KAFKA_PORT),
            redis_port=_int(environ, "DUAL_RAIL_REDIS_PORT", DEFAULT_REDIS_PORT),
        )

    @property
    def bootstrap(self) -> str:
        return self.kafka_bootstrap or f"127.0.0.1:{self.kafka_port}"

    @property
    def redis(self) -> str:
        return self.redis_url or f"redis://127.0.0.1:{self.redis_port}/0"
