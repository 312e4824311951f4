"""Build a process role's components from the environment (shared by the CLI and the tests).

    KAFKA_BOOTSTRAP_SERVERS, REDIS_URL        where the stack is (default: the local stack)
    DUAL_RAIL_TOPIC_NAMESPACE                 prefix for topic, group and Redis key names
    RESEND_BASE_URL, SMS_BASE_URL             provider endpoints
    RESEND_API_KEYS, SMS_API_KEYS             JSON {tenant: key}; "*" is the default key
    PROVIDER_TIMEOUT_S                        provider request timeout (default 10)
    DUAL_RAIL_RETRY_POLICIES                  retry policy file (default: streams/retry_policies.toml)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

import redis

from .errors import ConfigError
from .lanes import CHANNELS, LANES, TopicNames
from .settings import StackSettings

PROVIDER_ENV = {"email": ("RESEND_BASE_URL", "RESEND_API_KEYS"), "sms": ("SMS_BASE_URL", "SMS_API_KEYS")}


@dataclass(frozen=True)
class Runtime:
    bootstrap: str
    redis_url: str
    names: TopicNames
    environ: Mapping[str, str]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "Runtime":
        stack = StackSettings.from_env(environ)
        return cls(stack.bootstrap, stack.redis, TopicNames(environ.get("DUAL_RAIL_TOPIC_NAMESPACE", "")),
                   dict(environ))

    @property
    def namespace(self) -> str:
        return self.names.namespace

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url, socket_timeout=5, socket_connect_timeout=2,
                                    health_check_interval=30)

    def provider(self, channel: str):
        from .providers import ResendEmail, SmsGateway

        if channel not in PROVIDER_ENV:
            raise ConfigError(f"no provider adapter for channel {channel!r} yet (have: {', '.join(PROVIDER_ENV)})")
        url_var, _ = PROVIDER_ENV[channel]
        url = self.environ.get(url_var)
        if not url:
            raise ConfigError(f"{url_var} is not set: where is the {channel} provider?")
        timeout = float(self.environ.get("PROVIDER_TIMEOUT_S", "10"))
        return (ResendEmail if channel == "email" else SmsGateway)(url, timeout_s=timeout)

    def credentials(self, channel: str):
        from .providers import ProviderCredentials

        var = PROVIDER_ENV[channel][1]
        return ProviderCredentials.parse(self.environ.get(var, ""), var)

    def policies(self):
        from .retry_policy import load_policies

        return load_policies(self.environ.get("DUAL_RAIL_RETRY_POLICIES"))

    def yield_policy(self):
        """YIELD_PAUSE_ABOVE / YIELD_RESUME_BELOW (messages), YIELD_PAUSE_ABOVE_SECONDS,
        YIELD_MIN_DWELL_S, YIELD_STALE_AFTER_S; YIELD_DISABLED=1 turns yielding off (baseline)."""
        from .yield_policy import YieldPolicy

        if self.environ.get("YIELD_DISABLED") == "1":
            return None
        e = self.environ
        try:
            return YieldPolicy(pause_above=int(e.get("YIELD_PAUSE_ABOVE", "100")),
                               resume_below=int(e.get("YIELD_RESUME_BELOW", "20")),
                               pause_above_seconds=float(e.get("YIELD_PAUSE_ABOVE_SECONDS", "0")),
                               min_dwell_s=float(e.get("YIELD_MIN_DWELL_S", "2")),
                               stale_after_s=float(e.get("YIELD_STALE_AFTER_S", "3")))
        except ValueError as exc:
            raise ConfigError(f"invalid YIELD_* setting: {exc}") from None

    def worker(self, channel: str, lane: str, concurrency: int = 8, consumer_overrides: dict | None = None,
               fifo: bool = False):
        from .gate import RedisGate
        from .idempotency import ProcessedJobs
        from .worker import LaneWorker, WorkerConfig

        if channel not in CHANNELS or lane not in LANES:
            raise ConfigError(f"unknown lane {channel}.{lane} (channels: {CHANNELS}, lanes: {LANES})")
        timeout = float(self.environ.get("PROVIDER_TIMEOUT_S", "10"))
        cfg = WorkerConfig(channel, lane, self.bootstrap, self.names, concurrency=concurrency,
                           lease_s=max(3 * timeout, 5.0),
                           yield_policy=self.yield_policy() if lane == "marketing" else None, fifo=fifo)
        client = self.redis()
        return LaneWorker(cfg, self.provider(channel), RedisGate(client, self.namespace),
                          ProcessedJobs(client, self.namespace, lease_s=cfg.lease_s),
                          self.credentials(channel), self.policies(), consumer_overrides)
