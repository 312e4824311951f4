"""Where webhooks may not go. Pure code; name resolution is passed in.

A tenant registers the URL, so a URL must never make us call into our own network: hosts that
resolve to loopback, private, link-local (cloud metadata lives there), multicast, reserved,
unspecified or any other address that is not on the public internet are refused, at registration
and again at every delivery (DNS can change between the two). An operator allow-list (hosts or
addresses) lifts the rule where a deployment needs it (the tests and the demo allow 127.0.0.1). In
production mode only https is accepted.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from yarl import URL

Resolver = Callable[[str], Iterable[str]]  # host -> its addresses
# AWS (and GCP, Azure IMDS, ...), AWS IPv6, Alibaba, Azure's platform address (wire server)
METADATA = frozenset({"169.254.169.254", "fd00:ec2::254", "100.100.100.200", "168.63.129.16"})
NAT64 = ipaddress.ip_network("64:ff9b::/96")  # the well-known NAT64 prefix: the last 32 bits are an IPv4 host
# Not yet in the ipaddress module's tables of this Python: IPv6 documentation (RFC 9637).
NOT_GLOBAL = (ipaddress.ip_network("3fff::/20"),)


# Never the URL itself: a refusal at delivery reaches logs and dead letters, and webhook URLs often carry a
# token in their path or query.
NOT_HTTP = "the URL is not an http(s) URL with a host"


class UnsafeUrl(ValueError):
    """A URL we refuse to call; the message says why."""


def wire_host(url: str) -> str:
    """The host name the HTTP client (aiohttp, which parses URLs with yarl) looks up and connects to: lower
    case, an internationalised name in its IDNA 2008 ASCII form. The check and every delivery resolve this
    same name: Python's own `idna` codec is IDNA 2003, in which `faß.de` is another domain (`fass.de`)."""
    try:
        return URL(url).raw_host or ""
    except (ValueError, UnicodeError):
        return ""


@dataclass(frozen=True)
class UrlPolicy:
    require_https: bool = True
    allow: frozenset[str] = field(default_factory=frozenset)  # hosts or addresses exempt from the address rules

    def check(self, url: str, resolve: Resolver) -> None:
        """Raise UnsafeUrl for a URL we may not call (resolving its host with `resolve`)."""
        try:
            parts = urlsplit(url)
            hostname = parts.hostname
        except ValueError:  # `http://[::1/x`: an unclosed bracket
            raise UnsafeUrl(NOT_HTTP) from None
        if parts.scheme not in ("https", "http") or not hostname:
            raise UnsafeUrl(NOT_HTTP)
        if parts.scheme != "https" and self.require_https:
            raise UnsafeUrl("webhook URLs must use https")
        if parts.username or parts.password:
            raise UnsafeUrl("webhook URLs may not carry credentials")
        try:
            port = parts.port
        except ValueError:  # out of range, or not a number
            port = 0
        if port == 0:
            raise UnsafeUrl("a webhook URL's port is a number from 1 to 65535 (or none)")
        host = wire_host(url)
        if not host:
            raise UnsafeUrl(NOT_HTTP)
        if host in self.allow:
            return
        if not _is_ip(host) and any(c in host for c in ":%"):
            # A bracketed host that is no IP address (`[v1.a:b.example.com]`, RFC 3986's IPvFuture): the delivery
            # client takes any host with a ':' for an address and connects without asking the pinned resolver, so
            # what was checked here would not be what it connects to.
            raise UnsafeUrl(f"the host {host!r} is neither a name nor an IP address")
        if not _is_ip(host) and _NUMERIC_LABEL.fullmatch(host.rstrip(".").rsplit(".", 1)[-1]):
            # An IPv4 address in another form (`127.1`, `0177.0.0.1`, `2130706433`, `0x7f.1`): name resolvers read
            # these variously, and the delivery client refuses them at every attempt; refused here, said so.
            raise UnsafeUrl(f"the host {host!r} is an IPv4 address in a short, octal or hex form: write it as four "
                            "decimal numbers (a.b.c.d)")
        # The reasons name the kind of address, never the address a name resolved to nor the
        # resolver's error: a tenant reads them, and must not map our internal names with them.
        try:
            addresses = [host] if _is_ip(host) else list(resolve(host))
        except (OSError, UnicodeError):  # UnicodeError: a label too long or empty (`a..com`)
            raise UnsafeUrl(f"the host {host!r} does not resolve") from None
        if not addresses:
            raise UnsafeUrl(f"the host {host!r} does not resolve")
        for address in addresses:
            if address not in self.allow and _forbidden(address):
                raise UnsafeUrl(f"the host {host!r} resolves to a {_forbidden(address)} address")


_NUMERIC_LABEL = re.compile(r"0[xX][0-9a-fA-F]*|[0-9]+")  # a host ending in one is an IPv4 address (WHATWG URL)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _forbidden(address: str) -> str:
    """Why an address may not be called ("" when it may)."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address):
        # An IPv4 address carried inside an IPv6 one reaches that IPv4 host: judge the IPv4 one.
        embedded = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if embedded is None and ip in NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            return _forbidden(str(embedded))
    if address in METADATA:
        return "cloud metadata"
    for kind, hit in (("unspecified", ip.is_unspecified), ("loopback", ip.is_loopback),
                      ("link-local", ip.is_link_local), ("multicast", ip.is_multicast), ("private", ip.is_private),
                      ("reserved", ip.is_reserved)):
        if hit:
            return kind
    if ip in ipaddress.ip_network("100.64.0.0/10"):  # carrier-grade NAT: not the public internet
        return "private"
    if isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local:  # fec0::/10, deprecated but routed inside
        return "private"
    # Whatever else is not the public internet (documentation, benchmarking, IETF protocol ranges...).
    if not ip.is_global or any(ip in net for net in NOT_GLOBAL):
        return "non-public"
    return ""
