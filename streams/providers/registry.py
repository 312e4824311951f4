"""Which provider serves which channel: one table. Pure code (adapters are imported when built).

Adding a channel's provider means one entry here (and its adapter module); the worker, the
runtime, the configuration and the CLI all read this table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import import_module

from ..errors import ConfigError


@dataclass(frozen=True)
class ProviderSpec:
    name: str               # the gate's bucket key and the metrics label
    channel: str
    url_var: str            # environment variable holding the base URL
    keys_var: str           # environment variable holding the API keys (JSON {tenant: key})
    adapter: str            # "module:Class" of the adapter
    batch_lanes: frozenset[str] = field(default_factory=frozenset)  # lanes that send through the batch endpoint
    batch_max: int = 1      # messages per batch request
    idempotent: bool = True  # honours Idempotency-Key: an unknown outcome may be re-sent under the same key
    shared_limit: bool = True  # one limit for all our traffic (a 429 holds every worker off it)
    auth: str = "api_key"    # "api_key" (per tenant, from keys_var) or "none"


PROVIDERS: dict[str, ProviderSpec] = {
    "email": ProviderSpec("resend", "email", "RESEND_BASE_URL", "RESEND_API_KEYS",
                          "streams.providers.resend:ResendEmail",
                          # Email blasts travel only through the batch endpoint (100 per request).
                          batch_lanes=frozenset({"marketing"}), batch_max=100),
    "sms": ProviderSpec("sms", "sms", "SMS_BASE_URL", "SMS_API_KEYS", "streams.providers.sms:SmsGateway"),
    # Each endpoint is its own receiver: no shared limit, no API key; receivers deduplicate by
    # webhook-id, so an unknown outcome may be sent again with the same id.
    "webhook": ProviderSpec("webhook", "webhook", "", "", "streams.webhooks.delivery:WebhookDelivery",
                            shared_limit=False, auth="none"),
}


def provider_for(channel: str) -> ProviderSpec:
    """The provider of a channel; ConfigError when the channel has no adapter yet."""
    spec = PROVIDERS.get(channel)
    if spec is None:
        raise ConfigError(f"no provider adapter for channel {channel!r} yet (have: {', '.join(PROVIDERS)})")
    return spec


def adapter_class(spec: ProviderSpec) -> type:
    module, _, cls = spec.adapter.partition(":")
    return getattr(import_module(module), cls)


class ProviderCredentials:
    """API keys per tenant (`*` is the default). One key per tenant keeps their requests apart."""

    def __init__(self, keys: dict[str, str]):
        self.keys = dict(keys)

    def for_tenant(self, tenant: str) -> str:
        key = self.keys.get(tenant) or self.keys.get("*")
        if not key:
            raise ConfigError(f"no provider API key for tenant {tenant!r} and no default '*'")
        return key
