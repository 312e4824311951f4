"""Providers as data (streams/providers/providers.toml): validation that names the provider and field,
which rejections fall back to the channel's next provider, tokens whose expiry is read from the token,
and the refresh-once rule on a 401. No network: the token endpoint and provider are httpx mocks."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jwt
import pytest

from streams.dispatch.routes import Route, Routes
from streams.errors import ConfigError, ProviderAuthError
from streams.providers.outcome import ProviderResult
from streams.providers.registry import DEFAULT_FILE, ProviderCredentials, load_registry, parse_registry
from streams.providers.sms_b import SmsGatewayB
from streams.providers.tokens import TokenRefused, TokenSource, expiry_s

REGISTRY = load_registry()


def test_the_packaged_file_declares_every_channel_in_order():
    assert [p.name for p in REGISTRY.for_channel("sms")] == ["sms", "sms-b"]
    assert REGISTRY.primary("email").batch_lanes == frozenset({"marketing"})
    assert REGISTRY.providers["sms-b"].allowed == {("POST", "/v2/messages"), ("POST", "/oauth/token")}


SMS_B = 'paths = ["POST /v2/messages"]\nidempotency_window = "24h"\nconcurrency = 32\n'  # the end of sms-b's entry


@pytest.mark.parametrize("change, message", [
    (("auth = \"token\"\nkeys_env", "auth = \"bearer\"\nkeys_env"), "provider #3 (sms-b): field 'auth'"),
    (('paths = ["POST /v2/messages"]', 'paths = ["/v2/messages"]'), "(sms-b): field 'paths'"),
    (('sms = ["sms", "sms-b"]', 'sms = ["sms", "sms-c"]'), "[channels] sms: no provider named 'sms-c'"),
    (('channel = "sms"\nadapter = "streams.providers.sms_b', 'channel = "fax"\nadapter = "streams.providers.sms_b'),
     "(sms-b): field 'channel'"),
    (('token_path = "POST /oauth/token"\n', ''), "(sms-b): field 'token_path' is required"),
    (('concurrency = 32\n\n[[provider]]\nname = "webhook"', 'concurency = 32\n\n[[provider]]\nname = "webhook"'),
     "unknown field(s) concurency"),
    (('concurrency = 32\n\n[[provider]]\nname = "webhook"', 'concurrency = 5000\n\n[[provider]]\nname = "webhook"'),
     "(sms-b): field 'concurrency' must be at most 1024"),
    # A type TOML allows but the field is not: read as written, never converted (a string "false" read as true)
    ((SMS_B, SMS_B + 'shared_limit = "false"\n'),
     "(sms-b): field 'shared_limit' must be true or false (got 'false')"),
    # How long the provider keeps keys is said, never assumed (an unknown outcome re-sent after it forgot: twice)
    (('idempotency_window = "24h"\nconcurrency = 32\n\n[[provider]]\nname = "webhook"',
      'concurrency = 32\n\n[[provider]]\nname = "webhook"'), "(sms-b): field 'idempotency_window' is required"),
    ((SMS_B, SMS_B.replace('"24h"', '"30m"')), "an hour or more ('24h', '7d'; a longer window counts as 7 days), "
                                               "or 'none' when it does not honour them (got '30m')"),
    ((SMS_B, SMS_B.replace('"24h"', '24')), "(sms-b): field 'idempotency_window' is required"),
    ((SMS_B, SMS_B + 'idempotent = false\n'), "(sms-b): field 'idempotent' is now 'idempotency_window'"),
    ((SMS_B, SMS_B + 'fallback_errors = "no_route"\n'),
     "(sms-b): field 'fallback_errors' must be a list of strings"),
    (('keys_env = "SMS_B_CREDENTIALS"', 'keys_env = 1'), "(sms-b): field 'keys_env' must be a string"),
    ((SMS_B, SMS_B.replace("32", "true")), "(sms-b): field 'concurrency' must be an integer >= 1"),
])
def test_a_bad_entry_is_refused_naming_the_provider_and_the_field(change, message):
    text = DEFAULT_FILE.read_text()
    assert change[0] in text
    with pytest.raises(ConfigError) as exc:
        parse_registry(text.replace(change[0], change[1], 1))
    assert message in str(exc.value)


class _Adapter:
    def close(self): pass


def _routes() -> Routes:
    return Routes([Route(REGISTRY.providers[n], _Adapter(), ProviderCredentials({"*": "k"})) for n in ("sms", "sms-b")])


@pytest.mark.parametrize("result, falls_back", [
    (ProviderResult("rejected", 200, error_name="no_message_id"), True),              # nothing was taken
    (ProviderResult("rejected", 400, error_name="unsupported_destination"), True),    # "not something we recognise"
    (ProviderResult("rejected", 400, error_name="invalid_recipient"), False),         # a business rule
    (ProviderResult("rejected", 422, error_name="validation_error"), False),
    (ProviderResult("rejected", 400, error_name="suppressed"), False),
    (ProviderResult("unknown", 409, error_name="invalid_idempotent_request"), False),  # already sent
    (ProviderResult("unavailable", 500, error_name="internal_server_error"), False),   # retried, not moved
    (ProviderResult("throttled", 429, error_name="rate_limit_exceeded"), False),
    (ProviderResult("auth", 401, error_name="invalid_api_key"), False),
    (ProviderResult("unknown", 502, error_name="bad_gateway"), False),                 # may have been sent
])
def test_only_named_rejections_fall_back(result, falls_back):
    routes = _routes()
    nxt = routes.fallback_for(routes.primary, result, ["sms"])
    assert (nxt is not None and nxt.name == "sms-b") is falls_back


def test_fallback_never_goes_back_nor_past_one_extra_provider():
    routes = _routes()
    unsupported = ProviderResult("rejected", 400, error_name="unsupported_destination")
    second = routes.by_name["sms-b"]
    assert routes.fallback_for(second, unsupported, ["sms", "sms-b"]) is None  # the last provider: none further
    assert routes.fallback_for(routes.primary, unsupported, ["sms", "sms-b"]) is None  # already tried: no loop


def _jwt(lifetime_s: float) -> str:
    return jwt.encode({"exp": time.time() + lifetime_s}, "a-test-signing-key-of-32-bytes!!", algorithm="HS256")


def test_the_expiry_comes_from_the_token_then_from_expires_in_never_a_guess():
    assert expiry_s(_jwt(30), 3600, time.time()) == pytest.approx(30, abs=1)  # the token wins over expires_in
    assert expiry_s("opaque-token", 45, time.time()) == 45
    with pytest.raises(ProviderAuthError, match="no expiry"):
        expiry_s("opaque-token", None, time.time())


class TokenEndpoint:
    def __init__(self, lifetime_s: float):
        self.lifetime_s, self.calls = lifetime_s, 0
        self.lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        with self.lock:
            self.calls += 1
        time.sleep(0.05)  # a slow endpoint: concurrent requests must share one refresh
        return httpx.Response(200, json={"access_token": _jwt(self.lifetime_s), "expires_in": 3600})


def test_one_refresh_at_a_time_shared_by_every_request_and_before_the_expiry():
    endpoint = TokenEndpoint(lifetime_s=3.0)
    clock = [0.0]
    source = TokenSource("p", httpx.Client(base_url="http://p.test", transport=httpx.MockTransport(endpoint)),
                         "/oauth/token", "id", "secret", clock=lambda: clock[0])
    with ThreadPoolExecutor(8) as pool:
        tokens = set(pool.map(lambda _: source.get(), range(32)))
    assert len(tokens) == 1 and endpoint.calls == 1
    clock[0] = 2.0   # within the lifetime, before the margin (3 s - 0.6 s)
    source.get()
    assert endpoint.calls == 1
    clock[0] = 2.5   # inside the margin: refreshed before it expires
    source.get()
    assert endpoint.calls == 2


def test_a_401_refreshes_once_and_sends_the_same_request_again_a_second_401_is_auth():
    endpoint = TokenEndpoint(lifetime_s=30)
    sent: list[tuple[str, str]] = []
    refuse = [1]

    def provider(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/oauth/token":
            return endpoint(request)
        sent.append((request.headers["authorization"], request.headers["idempotency-key"]))
        if refuse[0] > 0:
            refuse[0] -= 1
            return httpx.Response(401, json={"error": {"code": "token_expired", "message": "x"}})
        return httpx.Response(201, json={"message": {"sid": "SM1"}})

    spec = REGISTRY.providers["sms-b"]
    adapter = SmsGatewayB(spec, "http://p.test", {"client_id": "id", "client_secret": "s"})
    adapter.client._transport.inner = httpx.MockTransport(provider)  # no network, same allowlist
    result = adapter.post("/v2/messages", b"{}", "unused", "send-1")
    assert result.outcome == "delivered" and result.message_ids == ("SM1",)
    assert len(sent) == 2 and sent[0][1] == sent[1][1] == "send-1" and sent[0][0] != sent[1][0]
    assert endpoint.calls == 2
    refuse[0] = 2
    sent.clear()
    assert adapter.post("/v2/messages", b"{}", "unused", "send-2").outcome == "auth"
    assert len(sent) == 2  # once more, never a third time


@pytest.mark.parametrize("answer, outcome, name", [
    (httpx.Response(401, json={"error": "invalid_client"}), "auth", "token_refused"),
    (httpx.Response(403, json={"error": "access_denied"}), "auth", "token_refused"),
    (httpx.Response(400, json={"error": "invalid_client"}), "auth", "token_refused"),
    (httpx.Response(400, json={"error": "unauthorized_client"}), "auth", "token_refused"),
    (httpx.Response(429, headers={"retry-after": "7"}), "throttled", "token_throttled"),
    (httpx.Response(503, text="down for maintenance"), "unavailable", "token_unavailable"),
    (httpx.Response(400, json={"error": "invalid_request"}), "unavailable", "token_unavailable"),
    (None, "unavailable", "token_unavailable"),  # the endpoint does not answer
], ids=["401", "403", "400 invalid_client", "400 unauthorized_client", "429", "503", "400 other", "unreachable"])
def test_a_token_endpoint_refusal_is_told_apart(answer, outcome, name):
    """Revoked client credentials are an `auth` outcome, as a 401 at the send endpoint (the provider is held,
    the alert fires, no attempt is used up); a 429 is `throttled` with the endpoint's Retry-After; anything
    else stays `unavailable`. The send endpoint is never called."""
    sends: list[httpx.Request] = []

    def provider(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/oauth/token":
            sends.append(request)
            return httpx.Response(201, json={"message": {"sid": "SM1"}})
        if answer is None:
            raise httpx.ConnectError("refused", request=request)
        return answer

    adapter = SmsGatewayB(REGISTRY.providers["sms-b"], "http://p.test", {"client_id": "id", "client_secret": "s3cr3t"})
    adapter.client._transport.inner = httpx.MockTransport(provider)  # no network, same allowlist
    result = adapter.post("/v2/messages", b"{}", "unused", "send-1")
    assert (result.outcome, result.error_name) == (outcome, name) and not sends
    assert result.status == (answer.status_code if answer is not None else None)
    assert result.retry_after == ("7" if outcome == "throttled" else None)
    assert "s3cr3t" not in result.error_body


@pytest.mark.parametrize("operator_pacing, cap", [(0, 8), (5, 5), (50, 8)])
def test_a_worker_never_keeps_more_requests_in_flight_than_its_own_slots(operator_pacing, cap):
    """providers.toml allows 32 per worker; a worker started with --concurrency 8 keeps at most 8, whatever the
    operator's pacing says above that (and what it reports in dispatch_provider_pacing is that cap)."""
    from streams.gate.limits import Pacing

    route = Route(REGISTRY.providers["sms"], _Adapter(), ProviderCredentials({"*": "k"}), slots=8)
    route.pacing = Pacing(concurrency=operator_pacing)
    assert REGISTRY.providers["sms"].concurrency == 32 and route.cap == cap


class FailingTokenEndpoint:
    """A token endpoint answering 503 (slowly), counting the requests it gets."""

    def __init__(self):
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        with self.lock:
            self.calls += 1
        time.sleep(0.05)  # a slow endpoint: the other requests wait for this answer
        return httpx.Response(503, json={"error": "temporarily_unavailable"})


def test_a_failing_token_endpoint_is_asked_once_by_the_requests_waiting_for_it():
    """Given a token endpoint that answers 503, and 32 requests needing a token at the same moment,
    When they ask for it,
    Then the endpoint is asked once and every request gets its refusal (before: each waiting request asked again in
    turn, 32 calls one after another, the last request waiting for all of them); a request made later asks again."""
    endpoint = FailingTokenEndpoint()
    clock = [0.0]
    source = TokenSource("p", httpx.Client(base_url="http://p.test", transport=httpx.MockTransport(endpoint)),
                         "/oauth/token", "id", "secret", clock=lambda: clock[0])

    def ask(_):
        with pytest.raises(TokenRefused) as refused:
            source.get()
        return refused.value.status, refused.value.error

    with ThreadPoolExecutor(8) as pool:
        answers = set(pool.map(ask, range(32)))
    assert answers == {(503, "temporarily_unavailable")} and endpoint.calls == 1
    clock[0] = 1.0
    assert ask(0) == (503, "temporarily_unavailable") and endpoint.calls == 2


def test_a_request_to_a_provider_without_idempotency_keys_keeps_its_record_a_day():
    """Given a provider that does not honour idempotency keys (`idempotency_window = "none"`),
    When its spec is read,
    Then it is not idempotent, yet a request's record is kept 23 h as for a day's window (a record kept 0 ms was
    deleted as it was written, and a webhook lane's claims, kept as long, could not be written at all)."""
    text = DEFAULT_FILE.read_text().replace(SMS_B, SMS_B.replace('"24h"', '"none"'), 1)
    spec = parse_registry(text).providers["sms-b"]
    assert not spec.idempotent and spec.record_ttl_ms == 23 * 3600 * 1000


def test_a_window_longer_than_the_claims_last_counts_as_seven_days():
    """Given a provider that keeps keys 30 days,
    When its spec is read,
    Then its window is taken as 7 days (a request's record never outlives the 7-day claims it guards)."""
    text = DEFAULT_FILE.read_text().replace(SMS_B, SMS_B.replace('"24h"', '"30d"'), 1)
    assert parse_registry(text).providers["sms-b"].idempotency_window_s == 7 * 24 * 3600
