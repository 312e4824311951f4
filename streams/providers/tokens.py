"""Short-lived provider tokens: obtained from the provider's token endpoint, cached until shortly
before the expiry the token itself states (its JWT `exp`, else the endpoint's `expires_in`), never
a guessed lifetime.

One refresh at a time per process: a request that finds the token stale waits for the refresh
already under way instead of starting its own, and shares its failure too (a token endpoint that
fails is asked once by the requests waiting for it, not once by each of them in turn). After a
401, `invalidate(token)` drops that token (only if it is still the current one: a request that used
an older token must not throw away the fresh one), and the next `get()` fetches a new one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import jwt
import orjson

from .. import metrics
from ..errors import ProviderAuthError
from . import connections
from .registry import HEADER_SAFE_RE

log = logging.getLogger("streams.providers")
MARGIN_S = 5.0          # refresh this long before the stated expiry ...
MARGIN_SHARE = 0.2      # ... or a fifth of the lifetime, whichever is shorter (a 3 s token: 0.6 s)


@dataclass(frozen=True)
class Token:
    value: str = field(repr=False)
    expires_at: float   # monotonic clock
    refresh_at: float


@dataclass(frozen=True)
class FailedFetch:
    at: float           # monotonic clock: when the token endpoint's failure was known
    error: ProviderAuthError

    def again(self) -> ProviderAuthError:
        """The same failure, as an exception of its own for another request's thread."""
        e = self.error
        if isinstance(e, TokenRefused):
            return TokenRefused(e.provider, e.status, e.retry_after, e.error)
        return ProviderAuthError(str(e))


def expiry_s(token: str, expires_in: object, now_unix: float) -> float:
    """Seconds the token lives: its `exp` claim (read, not verified: we are its bearer, not its
    audience), else `expires_in`. Raises ProviderAuthError when neither says."""
    try:
        exp = jwt.decode(token, options={"verify_signature": False}).get("exp")
    except jwt.PyJWTError:
        exp = None
    if isinstance(exp, (int, float)):
        return float(exp) - now_unix
    if isinstance(expires_in, (int, float)) and expires_in > 0:
        return float(expires_in)
    raise ProviderAuthError("the token endpoint's answer states no expiry (no JWT exp, no expires_in)")


class TokenRefused(ProviderAuthError):
    """The token endpoint answered, with a non-2xx: its status, Retry-After and OAuth `error` (never its body,
    which may quote the credentials)."""

    def __init__(self, provider: str, status: int, retry_after: str | None, error: str):
        super().__init__(f"token endpoint of {provider} answered {status}" + (f" {error}" if error else ""))
        self.provider, self.status, self.retry_after, self.error = provider, status, retry_after, error


def oauth_error(body: bytes) -> str:
    """The `error` of an OAuth error answer (RFC 6749 5.2), "" when there is none."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return ""
    error = doc.get("error") if isinstance(doc, dict) else None
    return error if isinstance(error, str) and error.isascii() and len(error) <= 64 else ""


class TokenSource:
    def __init__(self, provider: str, client: httpx.Client, path: str, client_id: str, client_secret: str,
                 clock: Callable[[], float] = time.monotonic, fresh: httpx.Client | None = None):
        self.provider, self.client, self.path = provider, client, path
        # Asks again through `fresh` (never a pooled connection) when the pooled one had been closed while idle.
        self.fresh = fresh
        self._credentials = {"grant_type": "client_credentials", "client_id": client_id,
                             "client_secret": client_secret}
        self.clock = clock
        self._token: Token | None = None
        self._failed: FailedFetch | None = None
        self._lock = threading.Lock()
        self.refreshes = 0

    def get(self) -> str:
        token = self._token
        asked = self.clock()
        if token is not None and asked < token.refresh_at:
            return token.value
        with self._lock:  # one refresh at a time; whoever waited finds the fresh token, or its failure
            token = self._token
            if token is not None and self.clock() < token.refresh_at:
                return token.value
            if self._failed is not None and self._failed.at >= asked:  # failed while this request waited
                raise self._failed.again()
            try:
                token = self._token = self._fetch()
            except ProviderAuthError as exc:
                self._failed = FailedFetch(self.clock(), exc)
                raise
            self._failed = None
            return token.value

    def _again(self) -> bool:
        """A token request's only effect is one more token issued: it may be asked again (once, on a new
        connection)."""
        if self.fresh is None:
            return False
        log.info("token endpoint of %s closed a pooled connection before answering: asked again on a new one",
                 self.provider)
        return True

    def invalidate(self, value: str) -> None:
        with self._lock:
            if self._token is not None and self._token.value == value:
                self._token = None

    def _fetch(self) -> Token:
        started = self.clock()
        timeout = self.client.timeout.read or 10.0
        try:
            resp = connections.post(self.client, self.client if self.fresh is None else self.fresh, self.path,
                                    orjson.dumps(self._credentials), {"Content-Type": "application/json"},
                                    lambda: timeout - (self.clock() - started), self._again)
        except httpx.TransportError as exc:
            raise ProviderAuthError(f"token endpoint of {self.provider} unreachable: {type(exc).__name__}") from None
        if not resp.is_success:
            raise TokenRefused(self.provider, resp.status_code, resp.headers.get("retry-after"),
                               oauth_error(resp.content))
        try:
            doc = orjson.loads(resp.content)
            value = str(doc["access_token"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            raise ProviderAuthError(f"token endpoint of {self.provider} answered without an access_token") from None
        if not HEADER_SAFE_RE.fullmatch(value):
            raise ProviderAuthError(f"token endpoint of {self.provider} answered an access_token an HTTP header "
                                    "cannot carry (a space, a line break, a non-ASCII letter)")
        lifetime = expiry_s(value, doc.get("expires_in"), time.time())
        if lifetime <= 0:
            raise ProviderAuthError(f"token endpoint of {self.provider} issued an expired token")
        self.refreshes += 1
        metrics.TOKEN_REFRESHES.labels(self.provider).inc()
        log.info("provider %s: new token, lives %.1f s", self.provider, lifetime)
        margin = min(MARGIN_S, lifetime * MARGIN_SHARE)
        return Token(value, started + lifetime, started + lifetime - margin)
