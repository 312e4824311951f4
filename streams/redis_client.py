"""The redis-py adapter pieces every role shares: a connection, the Lua scripts shipped beside
their adapters, and the translation of every Redis error into StoreUnavailable."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources

import redis

from .errors import StoreUnavailable


def connect(url: str) -> redis.Redis:
    """A client that fails fast (a short timeout) so callers can hold and retry, never hang."""
    return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2, health_check_interval=30)


def load_script(package: str | None, name: str) -> str:
    """A Lua script shipped beside the adapter that loads it."""
    return resources.files(package or "streams").joinpath(name).read_text()


@contextmanager
def store_errors(what: str, error: type[StoreUnavailable] = StoreUnavailable) -> Iterator[None]:
    """Translate any Redis failure inside the block into `error` naming `what` was being done."""
    try:
        yield
    except redis.RedisError as exc:
        raise error(f"{what}: Redis unavailable ({exc})") from None
