"""The composition root: builds each process role from the configuration (the CLI, the dev tools
and the tests all build roles here, so a role is wired one way only)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from redis import Redis

from .config import Config
from .errors import ConfigError
from .lanes import CHANNELS, LANES
from .names import TopicNames
from .providers.registry import ProviderCredentials, ProviderSpec, adapter_class
from .redis_client import connect

if TYPE_CHECKING:
    from .dispatch.requests import Job
    from .dispatch.routes import Routes
    from .dispatch.worker import LaneWorker
    from .gate.gate import Gate
    from .gate.limits import LimitStore
    from .ingest.api_keys import ApiKeys
    from .ingest.sdk import Router, SendClient
    from .ingest.sender_store import SenderDomainStore
    from .ingest.status import StatusStore
    from .providers.http import Provider
    from .providers.outcome import ProviderResult
    from .retry.policy import RetryPolicy
    from .retry.retrier import Retrier
    from .send import Send
    from .state.audit import AuditLog
    from .state.guard import StateGuard
    from .state.log import OperatorLog
    from .webhooks.endpoints import EndpointDirectory, EndpointStore
    from .webhooks.ingest import WebhookIngest
    from .webhooks.ssrf import UrlPolicy


MARKETING_CONCURRENCY = 8     # batch requests in flight per marketing worker
WEBHOOK_CONCURRENCY = 1024    # deliveries in flight per webhook worker


class Runtime:
    def __init__(self, config: Config):
        self.config = config
        self._send_clients: list[SendClient] = []

    def close(self) -> None:
        """Close every send client this runtime made (their producers flush and stop polling)."""
        while self._send_clients:
            self._send_clients.pop().close()

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
        """The retry policies, each checked against the retry tiers' retention (as topics/*.toml define them)."""
        from .retry.policy import check_tiers_keep_copies, load_policies
        from .topology.spec import load_definitions

        policies = load_policies(self.config.retry_policies_path)
        check_tiers_keep_copies(policies, load_definitions(namespace=self.namespace,
                                                           profile=self.config.topic_profile), self.names)
        return policies

    def url_policy(self) -> UrlPolicy:
        from .webhooks.ssrf import UrlPolicy

        return UrlPolicy(self.config.webhook_require_https, self.config.webhook_allow_hosts)

    def sender_store(self, client: Redis | None = None) -> SenderDomainStore:
        """Sender domains: SENDER_DOMAINS, overridden per tenant by what operators set."""
        from .ingest.sender_store import SenderDomainStore

        return SenderDomainStore(client or self.redis(), self.namespace, self.operator_log(),
                                 self.config.sender_domains)

    def endpoint_store(self, client: Redis | None = None) -> EndpointStore:
        from .webhooks.endpoints import EndpointStore
        from .webhooks.lookups import system_resolver

        system_resolver.start()  # here, not at a request's first lookup on the API's event loop
        return EndpointStore(client or self.redis(), self.namespace, self.operator_log(), self.url_policy(),
                             system_resolver, self.config.webhook_secret_keys)

    def webhook_ingest(self, client: Redis, send_client: SendClient, store: StatusStore) -> WebhookIngest:
        """The webhook side of the ingest API (call `follow()` to keep its endpoint view current)."""
        from .ingest.members import MemberStore
        from .webhooks.backlog import EndpointBacklog
        from .webhooks.fanout import BacklogLimit
        from .webhooks.ingest import WebhookIngest

        c = self.config
        return WebhookIngest(self.endpoint_store(client), self.endpoint_directory(),
                             EndpointBacklog(client, self.namespace),
                             BacklogLimit(c.webhook_backlog_max_count, int(c.webhook_backlog_max_age_s * 1000)),
                             MemberStore(client, self.namespace, self.operator_log()), send_client, store)

    def endpoint_directory(self) -> EndpointDirectory:
        """A started view of every endpoint, its health and every project's members (poll it)."""
        from .webhooks.endpoints import EndpointDirectory

        directory = EndpointDirectory(self.bootstrap, self.names.operator, self.names.endpoint_state)
        directory.start()
        return directory

    def provider(self, spec: ProviderSpec, concurrency: int = 8) -> Provider:
        """The adapter of one provider. ConfigError names the variable when its base URL is missing."""
        if spec.channel == "webhook":
            from .webhooks.delivery import WebhookDelivery

            return WebhookDelivery(self.endpoint_directory(), self.url_policy(), self.config.webhook_timeout_s,
                                   concurrency, self.config.webhook_secret_keys)
        endpoint = self.config.providers[spec.name]
        if not endpoint.base_url:
            raise ConfigError(f"{spec.base_url_env} is not set: where is the {spec.channel} provider {spec.name!r}?")
        return adapter_class(spec)(spec, endpoint.base_url, endpoint.api_keys if spec.auth == "token" else None,
                                   timeout_s=self.config.provider_timeout_s, concurrency=concurrency)

    def routes(self, channel: str, concurrency: int = 8, gate: Gate | None = None) -> Routes:
        """The channel's providers in fallback order. The first is required; a later one whose base
        URL is not set is left out (the channel then has no fallback), with a warning."""
        from .dispatch.routes import Route, Routes

        routes = []
        for i, spec in enumerate(self.config.registry.for_channel(channel)):
            if i > 0 and not self.config.providers[spec.name].base_url:
                logging.getLogger("streams.runtime").warning(
                    "%s is not set: %s sends have no fallback to provider %r", spec.base_url_env, channel, spec.name)
                continue
            routes.append(Route(spec, self.provider(spec, concurrency), self.credentials(spec), slots=concurrency))
        return Routes(routes, gate)

    def operator_log(self) -> OperatorLog:
        from .state.log import OperatorLog

        return OperatorLog(self.bootstrap, self.names.operator)

    def audit_log(self) -> AuditLog:
        from .state.audit import AuditLog

        return AuditLog(self.bootstrap, self.names.audit)

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

    def credentials(self, spec: ProviderSpec) -> ProviderCredentials:
        if spec.auth == "none":
            return ProviderCredentials({"*": "none"})  # webhook endpoints are authenticated by our signature
        if spec.auth == "token":
            return ProviderCredentials({"*": "token"})  # one account: the adapter holds the token
        return ProviderCredentials(self.config.providers[spec.name].api_keys)

    def default_concurrency(self, channel: str, lane: str) -> int:
        """Requests in flight per worker unless set: webhooks WEBHOOK_CONCURRENCY (receivers are slow
        and each endpoint gets its own share); the transactional lane as many as its first provider
        takes from one worker (providers.toml `concurrency`): its requests are single sends, and a
        provider slowed by a blast must not queue the next OTP behind a few slow answers;
        marketing MARKETING_CONCURRENCY batch requests (the gate, not the slots, sets its pace)."""
        if channel == "webhook":
            return WEBHOOK_CONCURRENCY
        if lane == "transactional":
            return self.config.registry.primary(channel).concurrency
        return MARKETING_CONCURRENCY

    def worker(self, channel: str, lane: str, concurrency: int | None = None, consumer_overrides: dict | None = None,
               queue_key: Callable[[Send], str] | None = None, yielding: bool = True,
               backlog: bool = True) -> LaneWorker:
        """A lane worker, with `concurrency` provider requests in flight at most (default:
        `default_concurrency`). `queue_key`, `yielding=False` and `backlog=False` exist for the
        benchmarks' naive baseline."""
        from .dispatch.backlog import HORIZON_S, BacklogShare
        from .dispatch.idempotency import CLAIM_TTL_MS, ProcessedJobs
        from .dispatch.tenant_queues import by_endpoint, by_tenant
        from .dispatch.worker import LaneWorker, WorkerConfig
        from .gate.gate import RedisGate
        from .kafka_client import durable_producer, lane_consumer

        if channel not in CHANNELS or lane not in LANES:
            raise ConfigError(f"unknown lane {channel}.{lane} (channels: {CHANNELS}, lanes: {LANES})")
        c = self.config
        concurrency = concurrency or self.default_concurrency(channel, lane)
        cfg = WorkerConfig(channel, lane, c.bootstrap, c.registry.primary(channel), c.names, concurrency=concurrency,
                           yield_policy=c.yield_policy if lane == "marketing" and yielding else None)
        consumer = lane_consumer(c.bootstrap, cfg.group, c.commit_interval_ms, **(consumer_overrides or {}))
        # Outcomes of transactional sends go out at once; a blast's are batched for a few milliseconds.
        producer = durable_producer(c.bootstrap, **{"linger.ms": 1 if lane == "transactional" else 5,
                                                    "message.timeout.ms": c.delivery_timeout_ms})
        client = self.redis()
        webhook = channel == "webhook"
        credentials = {spec.name: self.credentials(spec) for spec in c.registry.for_channel(channel)}
        gate = RedisGate(client, c.namespace, own_account=lambda provider, tenant: (
            (keys := credentials.get(provider)) is not None and keys.has_own_key(tenant)))
        worker = LaneWorker(cfg, consumer, producer, self.routes(channel, concurrency, gate),
                            gate, ProcessedJobs(client, c.namespace, lease_s=cfg.lease_s, epoch_required=True,
                                                claim_ttl_ms=cfg.provider.record_ttl_ms if webhook else CLAIM_TTL_MS),
                            self.policies(),
                            queue_key or (by_endpoint if webhook else by_tenant),
                            guard=self.state_guard(f"worker {channel}.{lane}", client),
                            backlog=BacklogShare(HORIZON_S[lane]) if backlog else None,
                            on_gone=self._disable_gone_endpoint(client) if webhook else None)
        if webhook:  # one queue per endpoint, each with a bounded share of the requests in flight
            worker.dispatcher.per_queue = c.webhook_endpoint_concurrency
            worker.dispatcher.per_tenant = max(c.webhook_endpoint_concurrency, cfg.concurrency // 2)
        worker.settler.time_scale = c.retry_time_scale
        worker.settler.auth_hold_s = c.provider_auth_hold_s
        if c.stage_log_path:
            from .dispatch.stages import StageLog

            worker.settler.stage_log = StageLog(c.stage_log_path)
        return worker

    def _disable_gone_endpoint(self, client: Redis) -> Callable[[Job, ProviderResult], bool]:
        """A receiver that answers 410 Gone asks not to be called again: its endpoint is disabled (in the
        background), unless its URL was changed since the request went out (False: the answer no longer speaks
        for the endpoint)."""
        from .webhooks.gone import GoneEndpoints

        return GoneEndpoints(self.endpoint_store(client))

    def send_client(self, router: Router | None = None, known_policies: frozenset[str] | None = None,
                    txn_instance: str | None = None) -> SendClient:
        from .ingest.sdk import SendClient
        from .retry.policy import load_policies, load_routing

        if known_policies is None:  # this runtime's file, not the process environment's
            known_policies = frozenset(load_policies(self.config.retry_policies_path))
        client = SendClient(self.bootstrap, self.names, known_policies=known_policies, router=router,
                            timeout_s=self.config.delivery_timeout_ms / 1000,
                            routing=load_routing(self.config.retry_policies_path), txn_instance=txn_instance)
        self._send_clients.append(client)
        return client

    def retrier(self, channel: str, lane: str) -> Retrier:
        from .retry.retrier import Retrier, RetrierConfig

        c = self.config
        return Retrier(RetrierConfig(channel, lane, c.bootstrap, c.names, commit_interval_ms=c.commit_interval_ms,
                                     delivery_timeout_ms=c.delivery_timeout_ms))
