"""Which sender domains a tenant may send email from. Pure code.

Tenants share the platform's account at an email provider, and with it every domain verified there:
without a rule, any tenant could send as another tenant's domain, or as the platform itself (its
endpoint alerts' sender). `SENDER_DOMAINS` (JSON `{tenant: [domain, ...]}`, `"*"` for tenants not
named) says which domains each may use in `from`; a subdomain of an allowed domain is allowed. Unset,
any sender is accepted (a development stack); a tenant with no entry and no `"*"` may send no email.
"""

from __future__ import annotations

import email.utils
import re
from dataclasses import dataclass, field

from ..errors import ConfigError

_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
# What domain_problem accepts, any case and with a final dot, as one pattern (the API's published schema).
DOMAIN_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)+\.?$"
MAX_DOMAINS = 100  # per tenant


def domain_problem(raw: str) -> str | None:
    """Why `raw` (any case, a final dot allowed) is not a domain name a sender may use, or None."""
    if len(raw) > 253:
        return "longer than 253 characters"
    domain = raw.lower().removesuffix(".")
    labels = domain.split(".")
    if len(labels) < 2:
        return "one label only (a sender domain has a dot, e.g. example.com)"
    if "" in labels:
        return "an empty label (a leading dot, or two dots in a row)"
    if not domain.isascii():
        return "not ASCII (give an internationalised domain in its xn-- form)"
    if not all(_LABEL.fullmatch(label) for label in labels):
        return "a label that is not 1 to 63 letters, digits or hyphens, or that starts or ends with a hyphen"
    return None


def address_domain(address: str) -> str:
    """The domain of `name@domain` or `Name <name@domain>` (already checked as an address), lower case."""
    bare = address[address.rindex("<") + 1:-1] if address.endswith(">") else address
    return bare.rsplit("@", 1)[1].lower()


@dataclass(frozen=True)
class SenderDomains:
    by_tenant: dict[str, frozenset[str]] = field(default_factory=dict)  # empty: any sender

    @classmethod
    def parse(cls, doc: object, where: str) -> SenderDomains:
        if not isinstance(doc, dict) or not all(
                isinstance(t, str) and isinstance(ds, list) and all(isinstance(d, str) for d in ds)
                for t, ds in doc.items()):
            raise ConfigError(f"{where} must be a JSON object of lists of domains ({{tenant: [domain, ...]}}, "
                              "\"*\" for tenants not named)")
        by_tenant = {}
        for tenant, domains in doc.items():
            domains = [d.strip() for d in domains]
            bad = sorted((d, problem) for d in domains if (problem := domain_problem(d)))
            if bad:
                raise ConfigError(f"{where}: tenant {tenant!r}: not a domain name: "
                                  + "; ".join(f"{d!r} ({problem})" for d, problem in bad))
            cleaned = frozenset(d.lower().removesuffix(".") for d in domains)
            if len(cleaned) > MAX_DOMAINS:
                raise ConfigError(f"{where}: tenant {tenant!r}: {len(cleaned)} domains, more than {MAX_DOMAINS}")
            by_tenant[tenant] = cleaned
        return cls(by_tenant)

    @property
    def enforced(self) -> bool:
        return bool(self.by_tenant)

    def rules_for(self, tenant: str) -> SenderDomains:
        """The rules that decide `tenant`'s senders (fixed rules: these; the operator's store reads Redis)."""
        return self

    def refusal(self, tenant: str, sender: str) -> str | None:
        """Why `tenant` may not send from `sender` (None: it may). Never repeats the address."""
        if not self.by_tenant:
            return None
        allowed = self.by_tenant.get(tenant, self.by_tenant.get("*"))
        if not allowed:
            return "this tenant has no sender domain: ask the operator to add one"
        # A mail parser must read the same single address as we do: `a@other.com, <x@ours.com>` is two
        # senders to it, and `x@other.com(.ours.com` one at other.com (the rest a comment).
        parsed = email.utils.getaddresses([sender])
        domain = address_domain(sender)
        if len(parsed) != 1 or parsed[0][1].rsplit("@", 1)[-1].lower() != domain:
            return "not one plain sender address (an unquoted comma, parenthesis or at sign reads as another)"
        if any(domain == d or domain.endswith("." + d) for d in allowed):
            return None
        return f"not a sender domain of this tenant (its domains: {', '.join(sorted(allowed))})"


def sender_of(payload: dict) -> str:
    """The email payload's sender (`from`, or its other accepted spelling `from_`)."""
    return str(payload.get("from") or payload.get("from_") or "")
