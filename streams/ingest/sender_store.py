"""Sender domains an operator sets at run time (`streams senders`, `PUT /v1/admin/senders/{tenant}`).

Like every piece of operator state they are written first to the operator log (key `senders/<tenant>`,
acknowledged), then to Redis (one hash, tenant -> its domains), which a Redis rebuild restores from the
log. What a tenant may send from: its own entry (the operator's, else `SENDER_DOMAINS`'), else the
`"*"` entry (the operator's, else the setting's). Rules are enforced as soon as either source names any
tenant; the API reads them on every request that holds an email (one Redis round trip), so a change
applies to the next request on every API process.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import orjson
import redis

from ..errors import ConfigError, SendValidationError
from ..names import RedisKeys
from ..redis_client import store_errors
from ..send import check_tenant_id
from ..state.log import write_through_log
from .senders import SenderDomains

if TYPE_CHECKING:
    from ..state.log import OperatorLog

ANY_TENANT = "*"
log = logging.getLogger("streams.senders")


class SenderDomainStore:
    def __init__(self, client: redis.Redis, namespace: str, oplog: OperatorLog | None,
                 setting: SenderDomains | None = None):
        self.client, self.key, self.oplog = client, RedisKeys(namespace).sender_domains, oplog
        self.setting = setting or SenderDomains()  # SENDER_DOMAINS: the defaults an operator's entries override

    def set(self, tenant: str, domains: list[str]) -> list[str]:
        """The tenant's domains (or `*`'s), replacing its entry (none: it may send no email); ConfigError says
        what is wrong."""
        if tenant != ANY_TENANT:
            try:
                check_tenant_id(tenant)
            except SendValidationError as exc:
                raise ConfigError(f"tenant: {exc}") from None
        cleaned = sorted(SenderDomains.parse({tenant: domains}, "domains").by_tenant[tenant])

        def write() -> bool:
            with store_errors("saving sender domains"):
                self.client.hset(self.key, tenant, orjson.dumps(cleaned))
            return True

        write_through_log(self.oplog, f"senders/{tenant}", {"domains": cleaned}, write,
                          lambda: self._logged_form(tenant), conditional=False)
        return cleaned

    def remove(self, tenant: str) -> bool:
        """The operator's entry gone (the setting's applies again); False: Redis held none. The removal is
        written to the operator log either way: a change whose Redis write failed after its log write left
        its entry there, which a Redis rebuild would otherwise bring back. A removal Redis refuses is taken back
        out of the log (`write_through_log`): kept there, a rebuild of Redis would apply it."""
        removed = False

        def write() -> bool:
            nonlocal removed
            with store_errors("removing sender domains"):
                removed = bool(self.client.hdel(self.key, tenant))
            return True

        write_through_log(self.oplog, f"senders/{tenant}", None, write, lambda: self._logged_form(tenant),
                          conditional=False)
        return removed

    def _logged_form(self, tenant: str) -> bytes | None:
        """What Redis holds for `tenant`, as its operator-log record (JSON), or None."""
        with store_errors("reading sender domains"):
            raw = self.client.hget(self.key, tenant)
        return None if raw is None else orjson.dumps({"domains": orjson.loads(raw)})

    def stored(self) -> dict[str, list[str]]:
        """The operator's entries."""
        with store_errors("reading sender domains"):
            raw = self.client.hgetall(self.key)
        return {t.decode(): orjson.loads(v) for t, v in sorted(raw.items())}

    def rules_for(self, tenant: str) -> SenderDomains:
        """The rules that decide `tenant`'s senders now (empty: not enforced, any sender)."""
        with store_errors("reading sender domains"):
            with self.client.pipeline(transaction=False) as pipe:
                pipe.hlen(self.key)
                pipe.hmget(self.key, [tenant, ANY_TENANT])
                count, (own, anyone) = pipe.execute()
        return effective_rules(self.setting, tenant, own, anyone, count > 0)


def effective_rules(setting: SenderDomains, tenant: str, own: bytes | None, anyone: bytes | None,
                    stored_any: bool) -> SenderDomains:
    """Pure: the rules for `tenant` from the setting and the operator's entries (`own`, `anyone`: the stored
    JSON lists of the tenant and of `*`; `stored_any`: the operator stored some entry)."""
    if not stored_any and not setting.enforced:
        return SenderDomains()
    by = setting.by_tenant
    if own is not None:
        chosen = orjson.loads(own)
    elif tenant in by:
        chosen = by[tenant]
    elif anyone is not None:
        chosen = orjson.loads(anyone)
    else:  # enforced: a tenant named nowhere gets no domain (no email), never "any sender"
        chosen = by.get(ANY_TENANT, frozenset())
    return SenderDomains({tenant: frozenset(chosen)})
