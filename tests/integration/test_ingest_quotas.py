"""Ingest quotas on the real gate (Redis): a request is admitted by all of its quotas or charged by none."""

import asyncio
from types import SimpleNamespace

import httpx

from streams.errors import PublishError, PublishOutcomeUnknown
from streams.gate.gate import RedisGate
from streams.ingest.api import Ingest, create_app
from streams.ingest.api_keys import Principal
from streams.ingest.idempotency import IngestIdempotency, body_hash
from streams.ingest.quotas import IngestQuotas, OverQuota
from streams.ingest.senders import SenderDomains
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


class Api:
    """The ingest API over the real gate and idempotency store (Redis), with a broker whose answers the test
    scripts (`broker`): acme's requests, posted as a batch under an Idempotency-Key."""

    def __init__(self, redis_client, namespace, broker):
        client = SimpleNamespace(names=None, routing=None, records=lambda sends: list(sends),
                                 publisher=SimpleNamespace(publish_async=broker, publish=lambda records: None))
        acme = SimpleNamespace(resolve=lambda token: Principal("tenant", "acme", "k1"))
        self.ingest = Ingest(client=client, store=SimpleNamespace(accepted=lambda sends: None),  # type: ignore
                             keys=acme, limits=None, known_policies=frozenset(), senders=SenderDomains(),
                             quotas=IngestQuotas(RedisGate(redis_client, namespace)),
                             idempotency=IngestIdempotency(redis_client, namespace))

    def post(self, batch: dict, key: str) -> httpx.Response:
        async def post() -> httpx.Response:
            transport = httpx.ASGITransport(create_app(self.ingest), raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://api") as api:
                return await api.post("/v1/sends/batch", json=batch,
                                      headers={"Authorization": "Bearer dr_ten_x", "Idempotency-Key": key})

        return asyncio.run(post())


def test_a_retry_of_a_request_that_may_have_been_published_is_not_charged_again(redis_client, namespace, limits):
    """Given acme's transactional quota of 50 (refilling 1 a second), and a broker that leaves a batch of 40
    receipts unconfirmed (it may have written them: 503 `outcome: unknown`) and then takes its retry,
    When acme retries the batch under its Idempotency-Key, and then posts another 40 under a new key,
    Then the retry is accepted, with the same send ids, charged nothing more (before, it was charged again:
    a tenant retrying through a broker's bad moment paid twice for sends delivered once, and was refused
    429), and the new batch is refused: the quota still holds."""
    limits.set_provider("ingest-transactional", 1_000_000, 1_000_000)
    limits.set_tenant("ingest-transactional", "*", 1, 50)
    published: list[list[object]] = []

    async def broker(records):
        published.append(records)
        if len(published) == 1:
            raise PublishOutcomeUnknown("the batch's commit did not finish (test)")
        return []

    api = Api(redis_client, namespace, broker)
    batch = {"sends": [email_request() for _ in range(40)]}
    first = api.post(batch, "batch-1")
    assert first.status_code == 503 and first.json()["outcome"] == "unknown", first.text
    retry = api.post(batch, "batch-1")
    assert retry.status_code == 202, retry.text
    assert [s.send_id for s in published[1]] == [s.send_id for s in published[0]]
    other = api.post(batch, "batch-2")
    assert other.status_code == 429 and other.json()["error"] == "quota_exceeded", other.text[:300]


def test_a_request_taking_over_a_key_whose_holder_was_never_charged_is_charged(redis_client, namespace, limits):
    """Given acme's transactional quota of 50, and an Idempotency-Key whose first holder died before its quotas
    were asked (its lease lapsed; nothing was charged),
    When acme posts the batch of 40 under that key, and then another 40 under a new key,
    Then the first is accepted and charged (before, any request taking a lapsed key over was taken as charged
    already: a tenant whose requests died early, or whose refused request could not free its key, sent them
    for free), and the second is refused: 80 do not fit in 50."""
    limits.set_provider("ingest-transactional", 1_000_000, 1_000_000)
    limits.set_tenant("ingest-transactional", "*", 1, 50)

    async def broker(records):
        return []

    api = Api(redis_client, namespace, broker)
    batch = {"sends": [email_request() for _ in range(40)]}
    dead = IngestIdempotency(redis_client, namespace, lease_s=0)  # its lease has lapsed as soon as it is taken
    dead.begin("acme", "batch-1", body_hash(batch), "POST /v1/sends/batch")
    taken_over = api.post(batch, "batch-1")
    assert taken_over.status_code == 202, taken_over.text
    other = api.post(batch, "batch-2")
    assert other.status_code == 429 and other.json()["error"] == "quota_exceeded", other.text[:300]


def test_a_refused_request_whose_key_was_taken_over_keeps_its_charge(redis_client, namespace, limits):
    """Given acme's transactional quota of 50, and a batch of 40 admitted (charged) whose publish takes so long
    that its key's lease lapses and a retry under the key takes it over (spared the quotas: the first attempt
    was charged for the same sends),
    When the broker then refuses the first attempt's publish whole,
    Then its charge is kept (before, it was given back: the retry went free of any charge), so a further 40
    under a new key are refused."""
    from streams.names import RedisKeys

    limits.set_provider("ingest-transactional", 1_000_000, 1_000_000)
    limits.set_tenant("ingest-transactional", "*", 1, 50)
    batch = {"sends": [email_request() for _ in range(40)]}
    retry = IngestIdempotency(redis_client, namespace)
    spared = []

    async def broker(records):
        if not spared:  # the first attempt's publish: its lease lapses, and the retry takes the key over
            redis_client.hset(RedisKeys(namespace).ingest_idempotency("acme", "batch-1"), "lease_until", 0)
            spared.append(retry.begin("acme", "batch-1", body_hash(batch), "POST /v1/sends/batch").charged_before)
            raise PublishError("the lane topic refused the batch (test)")
        return []

    api = Api(redis_client, namespace, broker)
    assert api.post(batch, "batch-1").status_code == 503
    assert spared[0]  # the retry was told the sends were charged
    other = api.post(batch, "batch-2")
    assert other.status_code == 429 and other.json()["error"] == "quota_exceeded", other.text[:300]


def test_a_refusal_by_the_shared_global_limit_says_so_not_the_tenants_own(redis_client, namespace, limits):
    """Given a transactional ingest quota whose global burst (every tenant's) is 10 requests, and a tenant quota of
    100 sends,
    When acme's 10 requests take the 10 and globex, far under its own quota, sends one receipt,
    Then globex is refused as over the shared limit (before: told it was over its own quota, which it was not);
    and once globex's own quota of 1 is what runs out, it is told that one."""
    limits.set_provider("ingest-transactional", 1, 10)
    limits.set_tenant("ingest-transactional", "*", 100, 100)
    quotas = IngestQuotas(RedisGate(redis_client, namespace))
    for _ in range(10):  # the global bucket counts requests, a tenant's counts sends
        assert quotas.admit("acme", sends("transactional", 1)) is None
    refused = quotas.admit("globex", sends("transactional", 1))
    assert isinstance(refused, OverQuota) and refused.quota == "ingest-transactional" and refused.shared
    limits.set_provider("ingest-transactional", 1_000_000, 1_000_000)
    limits.set_tenant("ingest-transactional", "globex", 1, 1)
    assert quotas.admit("globex", sends("transactional", 1)) is None
    own = quotas.admit("globex", sends("transactional", 1))
    assert isinstance(own, OverQuota) and not own.shared


def test_a_quota_edited_by_hand_to_zero_refuses_the_request_rather_than_lifting_the_quota(redis_client, namespace,
                                                                                         limits):
    """Given acme's transactional quota whose rate an operator edited into Redis by hand as 0 (past `streams limits
    set`, which refuses it),
    When acme posts a batch,
    Then it is refused 503, saying the quota is misconfigured, and nothing is published (taken as a quota nobody
    set, it was admitted without any limit)."""
    from streams.names import RedisKeys

    limits.set_provider("ingest-transactional", 1_000_000, 1_000_000)
    limits.set_tenant("ingest-transactional", "*", 1, 50)
    redis_client.hset(RedisKeys(namespace).limits("ingest-transactional"), "tenant_rate:*", 0)
    published: list[list[object]] = []

    async def broker(records):
        published.append(records)
        return []

    refused = Api(redis_client, namespace, broker).post({"sends": [email_request()]}, "batch-1")
    assert refused.status_code == 503 and "quota of this tenant is misconfigured" in refused.text, refused.text
    assert published == []
