"""Tenants share the platform's email provider account: each may send only from its own domains, so
none can send as another tenant or as the platform (its alert emails' sender)."""

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from streams.config import Config
from streams.errors import ConfigError
from streams.ingest.api import Ingest, create_app
from streams.ingest.api_keys import Principal
from streams.ingest.sender_store import effective_rules
from streams.ingest.senders import SenderDomains, address_domain
from tests.harness import email_request, sms_request

DOMAINS = SenderDomains.parse({"acme": ["acme.test"], "*": ["shared.test"]}, "test")


@pytest.mark.parametrize("tenant, sender, allowed", [
    ("acme", "Acme <no-reply@acme.test>", True),
    ("acme", "news@mail.ACME.test", True),                  # a subdomain, any case
    ("acme", "Dual-rail webhooks <alerts@dual-rail.dev>", False),  # the platform's own sender
    ("acme", "billing@globex.test", False),                 # another tenant's domain
    ("acme", "x@notacme.test", False),                      # a suffix is not a subdomain
    ("acme", "x@acme.test.evil.test", False),
    ("globex", "team@shared.test", True),                   # "*": tenants not named
    ("globex", "team@acme.test", False),
    ("acme", "boss@globex.test, <x@acme.test>", False),      # two senders to a mail parser
    ("acme", "x@globex.test(.acme.test", False),            # one at globex.test, the rest a comment
    ("acme", '"Doe, Jane" <jane@acme.test>', True),         # a quoted comma is part of the name
])
def test_a_tenant_sends_only_from_its_own_domains(tenant, sender, allowed):
    assert (DOMAINS.refusal(tenant, sender) is None) == allowed
    if not allowed:
        assert "@" not in DOMAINS.refusal(tenant, sender)  # the refused address is not repeated


def test_domains_are_taken_in_any_case_with_a_final_dot_and_in_their_xn_form():
    parsed = SenderDomains.parse({"acme": ["ACME.Test.", " mail.acme.test", "xn--fa-hia.de", "a-b.test"]}, "test")
    assert parsed.by_tenant["acme"] == {"acme.test", "mail.acme.test", "xn--fa-hia.de", "a-b.test"}


def test_unset_means_any_sender_and_a_tenant_without_domains_sends_no_email():
    assert SenderDomains().refusal("acme", "anyone@anywhere.test") is None
    only_acme = SenderDomains.parse({"acme": ["acme.test"]}, "test")
    assert "no sender domain" in only_acme.refusal("globex", "team@globex.test")
    assert address_domain('"Doe, Jane" <jane@Example.TEST>') == "example.test"


@pytest.mark.parametrize("raw, message", [
    ('["acme.test"]', "must be a JSON object of lists of domains"),
    ('{"acme": "acme.test"}', "must be a JSON object of lists of domains"),
    ('{"acme": ["acme test"]}', "tenant 'acme': not a domain name: 'acme test'"),
    ('{"acme": ["localhost"]}', "not a domain name: 'localhost' (one label only"),
    ('{"acme": [".acme.test"]}', "'.acme.test' (an empty label"),
    ('{"acme": ["acme..test"]}', "'acme..test' (an empty label"),
    ('{"acme": ["-.-"]}', "'-.-' (a label that is not 1 to 63 letters, digits or hyphens, or that starts or ends"),
    ('{"acme": ["a-.test"]}', "'a-.test' (a label that is not"),
    ('{"acme": ["%s.test"]}' % ("a" * 64), "(a label that is not 1 to 63"),
    ('{"acme": ["faß.de"]}', "'faß.de' (not ASCII (give an internationalised domain in its xn-- form))"),
    ('{"acme": [' + ", ".join(f'"d{i}.test"' for i in range(101)) + "]}", "tenant 'acme': 101 domains, more than 100"),
    ("{not json", "must be a JSON object of lists of domains"),
])
def test_a_bad_setting_names_the_variable_and_what_is_wrong(raw, message):
    with pytest.raises(ConfigError, match="environment variable SENDER_DOMAINS") as err:
        Config.from_env({"SENDER_DOMAINS": raw})
    assert message in str(err.value)


class OneTenant:
    def resolve(self, token: str) -> Principal:
        return Principal("tenant", "acme", "k1")


def test_the_api_refuses_an_email_from_another_domain_naming_the_field_and_publishes_nothing():
    """Given the ingest API with acme allowed acme.test only (its publisher fails the test if reached),
    When acme posts an email from globex.test, and a batch whose second email is from the platform's sender,
    Then both are refused (422) naming `payload.from` (and the batch's index), before anything is published;
    an SMS is not concerned by sender domains."""
    client = SimpleNamespace(names=None, routing=None,
                             records=lambda sends: pytest.fail("nothing may be published"))
    ingest = Ingest(client=client, store=None, keys=OneTenant(), limits=None,  # type: ignore[arg-type]
                    known_policies=frozenset(), senders=DOMAINS)

    async def post(path: str, body: dict) -> httpx.Response:
        transport = httpx.ASGITransport(create_app(ingest), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as api:
            return await api.post(path, json=body, headers={"Authorization": "Bearer dr_ten_x"})

    one = asyncio.run(post("/v1/sends", email_request(**{"from": "Billing <billing@globex.test>"})))
    assert one.status_code == 422 and one.json()["errors"][0]["loc"] == ["body", "payload", "from"]
    batch = asyncio.run(post("/v1/sends/batch", {"sends": [
        email_request(**{"from": "Acme <no-reply@acme.test>"}),
        email_request(**{"from": "Dual-rail webhooks <alerts@dual-rail.dev>"}), sms_request()]}))
    assert batch.status_code == 422
    assert [e["loc"] for e in batch.json()["errors"]] == [["body", "sends", 1, "payload", "from"]]
    assert "acme.test" in batch.json()["errors"][0]["msg"] and "dual-rail.dev" not in batch.text
    spoofed = asyncio.run(post("/v1/sends", email_request(**{"from": "Acme <no-reply@acme.test>",
                                                             "headers": {"Sender": "ceo@globex.test"}})))
    assert spoofed.status_code == 422
    assert spoofed.json()["errors"][0]["loc"] == ["body", "payload", "headers", "Sender", "[key]"]
    assert "the sender by `from`" in spoofed.json()["errors"][0]["msg"]


def test_the_other_spelling_of_from_is_checked_and_never_a_500():
    """`from_` is accepted for `from` (populate_by_name): it is checked the same (before, such a request was
    answered 500: the check read `from` only; and unset, the check is not made at all)."""
    client = SimpleNamespace(names=None, routing=None, records=lambda sends: pytest.fail("nothing may be published"))

    async def post(senders: SenderDomains) -> httpx.Response:
        ingest = Ingest(client=client, store=None, keys=OneTenant(), limits=None,  # type: ignore[arg-type]
                        known_policies=frozenset(), senders=senders)
        transport = httpx.ASGITransport(create_app(ingest), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as api:
            return await api.post("/v1/sends", headers={"Authorization": "Bearer dr_ten_x"}, json={
                **email_request(), "payload": {"from_": "billing@globex.test", "to": "user@example.test",
                                               "subject": "Hi", "html": "<p>Hi</p>"}})

    refused = asyncio.run(post(DOMAINS))
    assert refused.status_code == 422 and refused.json()["errors"][0]["loc"] == ["body", "payload", "from"]
    assert not SenderDomains().enforced


@pytest.mark.parametrize("setting, own, anyone, stored_any, allowed, refused", [
    ({}, None, None, False, ["x@anything.test"], []),                          # nothing anywhere: any sender
    ({"acme": ["acme.test"]}, None, None, False, ["a@acme.test"], ["a@other.test"]),
    ({"acme": ["acme.test"]}, b'["acme.io"]', None, True, ["a@acme.io"], ["a@acme.test"]),  # the operator's wins
    ({"*": ["shared.test"]}, None, b'["pool.test"]', True, ["a@pool.test"], ["a@shared.test"]),
    ({"acme": ["acme.test"]}, None, b'["pool.test"]', True, ["a@acme.test"], ["a@pool.test"]),  # own before "*"
    ({}, None, None, True, [], ["a@acme.test"]),             # others set by operators: acme named nowhere, no email
    ({"acme": ["acme.test"]}, b"[]", None, True, [], ["a@acme.test"]),  # an empty entry: no email at all
])
def test_an_operators_entry_overrides_the_settings_for_its_tenant(setting, own, anyone, stored_any, allowed, refused):
    rules = effective_rules(SenderDomains.parse(setting, "test"), "acme", own, anyone, stored_any)
    assert [s for s in allowed if rules.refusal("acme", s) is not None] == []
    assert [s for s in refused if rules.refusal("acme", s) is None] == []
