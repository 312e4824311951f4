"""No request reaches the provider's audiences, contacts, segments, broadcasts or topics APIs.

Three layers: (1) the HTTP client refuses any path outside its allowlist before sending;
(2) the mock provider counts forbidden requests, and the `mock_provider` fixture fails any test of
the suite after which that count is not zero; (3) no module of the package names those paths."""

import re
from pathlib import Path

import pytest

from streams.errors import ForbiddenProviderPath
from streams.providers.registry import adapter_class, load_registry

FORBIDDEN = ["/audiences", "/contacts", "/segments", "/broadcasts", "/topics", "/audiences/a1/contacts",
             "/emails/e1"]


@pytest.mark.parametrize("path", FORBIDDEN)
def test_client_refuses_paths_outside_the_allowlist_before_sending(mock_provider, path):
    """Given every HTTP provider of providers.toml (Resend, both SMS providers, one with token auth) and a
    forbidden path (audiences, contacts, segments, broadcasts, topics, or reading an email back),
    When its client is asked to post to that path,
    Then it refuses with "not in the provider allowlist" and no request reaches the provider (not even a
    token request)."""
    creds = {"client_id": "mock-client", "client_secret": "mock-secret"}
    specs = [s for s in load_registry().providers.values() if s.channel != "webhook"]
    assert {s.name for s in specs} >= {"resend", "sms", "sms-b"}
    for spec in specs:
        provider = adapter_class(spec)(spec, mock_provider.url, creds)
        with pytest.raises(ForbiddenProviderPath, match="not in the provider allowlist"):
            provider.post(path, b"{}", "re_key", "k")
        provider.close()
    stats = mock_provider.stats()
    assert stats["requests_total"] == 0 and stats["token_requests"] == 0


def test_the_mock_counts_a_forbidden_request(mock_provider):
    """Given the mock provider,
    When a request is posted directly to its /audiences endpoint,
    Then the mock counts exactly one forbidden request (and is reset, as the request was deliberate)."""
    import httpx

    httpx.post(f"{mock_provider.url}/audiences", json={"name": "all"})
    assert mock_provider.stats()["forbidden"] == 1
    mock_provider.reset()  # this test made the request on purpose


def test_no_module_of_the_package_names_a_contacts_api():
    """Given the source of every module of the streams package except the mock provider,
    When it is scanned for the audiences, contacts, segments and broadcasts paths,
    Then no line of code (comments and docstring openings aside) names any of them."""
    package = Path(__file__).resolve().parents[2] / "streams"
    pattern = re.compile(r"""["'/](audiences|contacts|segments|broadcasts)\b""")
    offenders = [f"{p.name}:{i}" for p in package.rglob("*.py") if p.name != "mock_provider.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if pattern.search(line) and not line.lstrip().startswith(("#", '"""'))]
    assert offenders == []
