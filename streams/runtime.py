"""The composition root: builds each process role from the configuration (the CLI, the dev tools
and the tests all build roles here, so a role is wired one way only)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from redis import Redis

from .config import Config
from .errors import ConfigError
from .lanes import CHANNELS, LANES
from .names import TopicNames
from .providers.registry import ProviderCredentials, adapter_class, provider_for
from .redis_client import connect

if TYPE_CHECKING:
    from .dispatch.worker import LaneWorker
    from .gate.limits import LimitStore
    from .ingest.api_keys import ApiKeys
    from .ingest.sdk import Router, SendClient
    from .providers.http import Provider
    from .retry.policy import RetryPolicy
    from .retry.retrier import Retrier
    from .send import Send
    from .state.guard import StateGuard
    from .state.log import OperatorLog


class Runtime:
    def __init__(self, config: Config):
        self.config = config

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Runtime:
        return cls(Config.from_env(environ))

    @property
    def bootstrap(self) -> str:
        return self.config.bootstrap

    @property
    def redis_url(self) -> str:
        return self.config.redis_url

    @property
    def names(self) -> TopicNames:
        return self.config.names

    @property
    def namespace(self) -> str:
        return self.config.namespace

    def redis(self) -> Redis:
        return connect(self.redis_url)

    def policies(self) -> dict[str, RetryPolicy]:
        from .retry.policy import load_policies

        return load_policies(self.config.retry_policies_path)

    def provider(self, channel: str) -> Provider:
        spec = provider_for(channel)
        endpoint = self.config.providers[spec.name]
        if not endpoint.base_url:
            raise ConfigError(f"{spec.url_var} is not set: where is the {channel} provider?")
        return adapter_class(spec)(endpoint.base_url, timeout_s=self.config.provider_timeout_s)

    def operator_log(self) -> OperatorLog:
        from .state.log import OperatorLog

        return OperatorLog(self.bootstrap, self.names.operator)

    def limit_store(self, client: Redis | None = None) -> LimitStore:
        from .gate.limits import LimitStore

        return LimitStore(client or self.redis(), self.namespace, self.operator_log())

    def api_keys(self, client: Redis | None = None) -> ApiKeys:
        from .ingest.api_keys import ApiKeys

        return ApiKeys(client or self.redis(), self.namespace, self.operator_log())

    def state_guard(self, role: str, client: Redis | None = None) -> StateGuard:
        """Detects lost Redis data and rebuilds operator state; checked at start, then every few seconds."""
        from .state.guard import StateGuard

        return StateGuard(client or self.redis(), self.config.keys, self.operator_log(), role)

    def credentials(self, channel: str) -> ProviderCredentials:
        return ProviderCredentials(self.config.providers[provider_for(channel).name].api_keys)

    def worker(self, channel: str, lane: str, concurrency: int = 8, consumer_overrides: dict | None = None,
               queue_key: Callable[[Send], str] | None = None, yielding: bool = True,
               backlog: bool = True) -> LaneWorker:
        """A lane worker. `queue_key`, `yielding=False` and `backlog=False` exist for the benchmarks'
        naive baseline."""
        from .dispatch.backlog import BacklogShare
        from .dispatch.idempotency import ProcessedJobs
        from .dispatch.tenant_queues import by_tenant
        from .dispatch.worker import LaneWorker, WorkerConfig
        from .gate.gate import RedisGate
        from .kafka_client import durable_producer, lane_consumer

        if channel not in CHANNELS or lane not in LANES:
            raise ConfigError(f"unknown lane {channel}.{lane} (channels: {CHANNELS}, lanes: {LANES})")
        spec = provider_for(channel)
        c = self.config
        cfg = WorkerConfig(channel, lane, c.bootstrap, spec, c.names, concurrency=concurrency,
                           yield_policy=c.yield_policy if lane == "marketing" and yielding else None)
        consumer = lane_consumer(c.bootstrap, cfg.group, c.commit_interval_ms, **(consumer_overrides or {}))
        producer = durable_producer(c.bootstrap, **{"linger.ms": 5, "message.timeout.ms": c.delivery_timeout_ms})
        client = self.redis()
        return LaneWorker(cfg, consumer, producer, self.provider(channel), RedisGate(client, c.namespace),
                          ProcessedJobs(client, c.namespace, lease_s=cfg.lease_s), self.credentials(channel),
                          self.policies(), queue_key or by_tenant,
                          guard=self.state_guard(f"worker {channel}.{lane}", client),
                          backlog=BacklogShare() if backlog else None)

    def send_client(self, router: Router | None = None, known_policies: frozenset[str] | None = None) -> SendClient:
        from .ingest.sdk import SendClient
        from .retry.policy import load_routing

        return SendClient(self.bootstrap, self.names, known_policies=known_policies, router=router,
                          timeout_s=self.config.delivery_timeout_ms / 1000,
                          routing=load_routing(self.config.retry_policies_path))

    def retrier(self, channel: str, lane: str) -> Retrier:
        from .retry.retrier import Retrier, RetrierConfig

        c = self.config
        return Retrier(RetrierConfig(channel, lane, c.bootstrap, c.names, commit_interval_ms=c.commit_interval_ms,
                                     delivery_timeout_ms=c.delivery_timeout_ms))
