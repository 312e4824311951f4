"""A tenant's project members: the email addresses that hear about the project's webhook endpoints
(the "Webhook event dropped" and "Webhook delivery stopped" alerts go to every member).

Managed by the tenant (`PUT /v1/members`, `GET /v1/members`). Like all operator state, written
first to the operator log (key `members/<tenant>`), then to Redis; the endpoint-health app follows
the log itself, so it knows the members without Redis.
"""

from __future__ import annotations

import orjson
import redis

from ..errors import ConfigError
from ..names import RedisKeys
from ..redis_client import store_errors
from ..send import MAX_RECIPIENTS, check_address
from ..state.log import OperatorLog, write_through_log


def check_members(emails: list[str]) -> tuple[str, ...]:
    """At most 50 distinct addresses (one alert email reaches them all: a provider's recipient limit)."""
    if not isinstance(emails, list) or len(emails) > MAX_RECIPIENTS:
        raise ConfigError(f"emails: a project has at most {MAX_RECIPIENTS} members")
    for i, address in enumerate(emails):
        try:
            check_address(address)
        except (ValueError, TypeError):
            raise ConfigError(f"emails[{i}]: not an email address") from None  # the value is not repeated
    return tuple(dict.fromkeys(emails))


class MemberStore:
    def __init__(self, client: redis.Redis, namespace: str, oplog: OperatorLog | None):
        self.client, self.keys, self.oplog = client, RedisKeys(namespace), oplog

    def set(self, tenant: str, emails: list[str]) -> tuple[str, ...]:
        members = check_members(emails)
        doc = {"tenant": tenant, "emails": list(members)}

        def write() -> bool:
            with store_errors("saving the project members"):
                self.client.set(self.keys.members(tenant), orjson.dumps(doc))
            return True

        # The workers' alerts follow the log: a list Redis refused is taken back out of it (`write_through_log`),
        # or alerts would go to addresses the operator was told were not added.
        write_through_log(self.oplog, f"members/{tenant}", doc, write, lambda: self._raw(tenant), conditional=False)
        return members

    def _raw(self, tenant: str) -> bytes | None:
        with store_errors("reading the project members"):
            return self.client.get(self.keys.members(tenant))

    def get(self, tenant: str) -> tuple[str, ...]:
        with store_errors("reading the project members"):
            raw = self.client.get(self.keys.members(tenant))
        return tuple(orjson.loads(raw)["emails"]) if raw else ()
