"""Ingest quotas on the real gate (Redis): a request is admitted by all of its quotas or charged by none."""

from streams.gate.gate import RedisGate
from streams.ingest.quotas import IngestQuotas, OverQuota
from streams.send import build_send, validate_request
from tests.harness import email_request


def sends(category: str, n: int):
    return [build_send(validate_request(email_request(category)), "acme") for _ in range(n)]


def test_a_request_refused_by_one_quota_is_charged_by_none(redis_client, namespace, limits):
    """Given acme's transactional quota of 100 (refilling 1 a second) and a marketing quota of 1, already used,
    When acme posts a batch of 60 receipts and 1 newsletter three times (each refused: marketing is over),
    Then a batch of 60 receipts alone is still admitted (before, each refused request had taken its 60
    transactional tokens: the tenant's own receipts and OTPs were refused for over a minute), and the
    requests quota, set too, was given back each time."""
    for quota, burst in (("ingest-transactional", 100), ("ingest-marketing", 1), ("ingest-requests", 5)):
        limits.set_provider(quota, 1_000_000, 1_000_000)
        limits.set_tenant(quota, "*", 1, burst)
    quotas = IngestQuotas(RedisGate(redis_client, namespace))
    assert quotas.admit("acme", sends("marketing", 1)) is None
    for _ in range(3):
        refused = quotas.admit("acme", sends("transactional", 60) + sends("marketing", 1))
        assert isinstance(refused, OverQuota) and refused.quota == "ingest-marketing"
    assert quotas.admit("acme", sends("transactional", 60)) is None
    assert quotas.admit("acme", sends("transactional", 1)) is None  # requests: 3 of 5 used, the refused given back
