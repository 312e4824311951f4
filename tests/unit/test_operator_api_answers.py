"""The operator API's answers where the state store fails after a change, or the change names nothing real."""

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from streams.errors import PublishError, ReplayOutcomeUnknown, StoreUnavailable, StoreWriteUnknown
from streams.gate.limits import AppliedLimits
from streams.ingest.api import Ingest, create_app
from streams.ingest.api_keys import KeyInfo, Principal, key_id
from streams.ingest.sender_store import SenderDomainStore
from streams.ingest.senders import SenderDomains
from streams.providers.registry import DEFAULT_FILE, parse_registry


class OperatorKeys:
    """An operator's key; keys it creates or rotates exist, but Redis cannot be asked about them afterwards."""

    def __init__(self):
        self.created: list[str] = []

    def resolve(self, token: str) -> Principal:
        if token in self.created:
            raise StoreUnavailable("checking the API key: Redis unavailable (test)")
        return Principal("operator", None, "op1")

    def create(self, role, tenant=None, label=""):
        self.created.append(f"dr_ten_new{len(self.created)}")
        return self.created[-1]

    def get(self, key_id):
        return KeyInfo(key_id, "tenant", "acme", 1, None, None, None, "")

    def rotate(self, key_id, overlap_s):
        return self.create("tenant", "acme"), KeyInfo(key_id, "tenant", "acme", 1, 2, None, None, "")


class Audit:
    def __init__(self):
        self.records: list[tuple] = []
        self.befores: list = []

    def record(self, who, what, before, after):
        self.records.append((what, after))
        self.befores.append(before)


class Limits:
    def __init__(self):
        self.applied: list[str] = []

    def show(self, provider):
        return {}

    def apply(self, provider, change):
        self.applied.append(provider)
        return AppliedLimits({}, {"global_rate": 1})


def _operator_api(keys, audit, limits) -> Ingest:
    client = SimpleNamespace(names=None, routing=None, records=lambda sends: pytest.fail("nothing may be published"))
    return Ingest(client=client, store=None, keys=keys, limits=limits, known_policies=frozenset(),  # type: ignore[arg-type]
                  audit=audit, senders=SenderDomains())  # type: ignore[arg-type]


def _call(ingest: Ingest, method: str, path: str, **request) -> httpx.Response:
    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(create_app(ingest), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as api:
            return await api.request(method, path, headers={"Authorization": "Bearer dr_ope_x"}, **request)
    return asyncio.run(call())


def test_a_key_created_or_rotated_is_answered_and_audited_though_redis_cannot_be_asked_about_it_after():
    """Given an operator, and a state store that fails as soon as the new keys exist,
    When a key is created and another rotated,
    Then both are answered 201 with the key and its id, from the key itself, and both are audited (before: the API
    asked Redis for the new key's id, answered 503 "retry", and the key existed, valid, shown to nobody and
    unaudited; a rotation's old key ran out meanwhile)."""
    keys, audit = OperatorKeys(), Audit()
    ingest = _operator_api(keys, audit, Limits())
    made = _call(ingest, "POST", "/v1/admin/keys", json={"role": "tenant", "tenant": "acme"})
    rotated = _call(ingest, "POST", "/v1/admin/keys/abc/rotate", json={"overlap_s": 0})
    assert (made.status_code, rotated.status_code) == (201, 201), (made.text, rotated.text)
    assert [made.json()["id"], rotated.json()["id"]] == [key_id(k) for k in keys.created]
    assert [what for what, _ in audit.records] == [f"apikey/{key_id(keys.created[0])}", "apikey/abc"]
    assert audit.records[1][1]["new_id"] == key_id(keys.created[1])


@pytest.mark.parametrize("provider", ["Resend", "ingest-request"])
def test_limits_for_a_provider_that_does_not_exist_are_refused_naming_the_known_ones(provider):
    """Given an operator,
    When limits are set or read for a misspelt provider or quota,
    Then 404 names the known ones, and nothing is written or audited (before: 200 and an audit record for limits
    that govern nothing, while the real provider stayed unlimited)."""
    audit, limits = Audit(), Limits()
    ingest = _operator_api(OperatorKeys(), audit, limits)
    put = _call(ingest, "PUT", f"/v1/admin/limits/{provider}", json={"global_rate": 10, "global_burst": 10})
    get = _call(ingest, "GET", f"/v1/admin/limits/{provider}")
    assert (put.status_code, get.status_code) == (404, 404), put.text
    assert "resend" in put.json()["errors"][0]["msg"] and (limits.applied, audit.records) == ([], [])
    assert _call(ingest, "PUT", "/v1/admin/limits/resend", json={"global_rate": 10, "global_burst": 10}).status_code == 200


class CoolDowns(Limits):
    def __init__(self):
        super().__init__()
        self.ended: list[str] = []

    def clear_cool_down(self, provider, tenant=None):
        self.ended.append(provider)
        return 30.0


def test_the_operator_api_knows_the_providers_of_the_configured_provider_file():
    """Given an API started with a provider file of its own (DUAL_RAIL_PROVIDERS), naming an email provider the
    packaged file does not have,
    When an operator sets that provider's limits and ends its cool-down, then asks the same of the webhook provider
    and of an ingest quota,
    Then the configured provider's are done and audited, and the cool-down of the others is refused 404 naming the
    providers that have one (before: the cool-down routes read the packaged file, and refused the configured
    provider)."""
    text = DEFAULT_FILE.read_text().replace('"resend"', '"postmark"')
    audit, limits = Audit(), CoolDowns()
    ingest = _operator_api(OperatorKeys(), audit, limits)
    ingest.registry = parse_registry(text, "own-providers.toml")
    put = _call(ingest, "PUT", "/v1/admin/limits/postmark", json={"global_rate": 10, "global_burst": 10})
    ended = _call(ingest, "DELETE", "/v1/admin/limits/postmark/cooldown")
    assert (put.status_code, ended.status_code) == (200, 200), (put.text, ended.text)
    assert (limits.applied, limits.ended) == (["postmark"], ["postmark"])
    assert [what for what, _ in audit.records] == ["limits/postmark", "cooldown/postmark"]
    for other in ("webhook", "ingest-request", "resend"):
        refused = _call(ingest, "DELETE", f"/v1/admin/limits/{other}/cooldown")
        assert refused.status_code == 404, refused.text
        assert "(providers that have one: postmark, sms, sms-b)" in refused.json()["errors"][0]["msg"]
    assert limits.ended == ["postmark"]


class AnswersLost(CoolDowns):
    """Ends the cool-down, and its answer is lost (a timeout after Redis ran it)."""

    def clear_cool_down(self, provider, tenant=None):
        super().clear_cool_down(provider, tenant)
        raise StoreUnavailable("ending a cool-down: Timeout reading from socket (test)")


class SendersAnswerLost(SenderDomainStore):
    """Holds acme's sender domains; their removal runs, and its answer is lost."""

    def __init__(self):
        pass  # no Redis: what it holds is below

    def stored(self):
        return {"acme": ["acme.test"]}

    def remove(self, tenant):
        raise StoreUnavailable("removing sender domains: Timeout reading from socket (test)")


def test_a_change_that_cannot_be_made_again_whose_answer_was_lost_is_on_the_audit_trail_as_maybe_applied():
    """Given a Redis that runs an operator's change and loses its answer: ending a provider's cool-down, removing a
    tenant's sender domains,
    When the operator makes the change (answered 503) and, told to retry, finds nothing left to change,
    Then the audit trail has the change, as maybe applied (before: nothing: the sender-domain removal, which
    widened acme's senders back to the defaults, was on no record at all)."""
    audit, limits = Audit(), AnswersLost()
    ingest = _operator_api(OperatorKeys(), audit, limits)
    ingest.senders = SendersAnswerLost()  # type: ignore[assignment]
    ended = _call(ingest, "DELETE", "/v1/admin/limits/resend/cooldown")
    removed = _call(ingest, "DELETE", "/v1/admin/senders/acme")
    assert (ended.status_code, removed.status_code) == (503, 503)
    assert audit.records == [("cooldown/resend", {"outcome": "unknown", "intended": {"cool_down_left_s": 0}}),
                             ("senders/acme", {"outcome": "unknown", "intended": None})]


class ChangedMeanwhile(Limits):
    """Another operator raised the global rate from 10 to 20 between a read of the limits and this change's
    compare-and-set, which held the 20."""

    def show(self, provider):
        return {"global_rate": 10}

    def apply(self, provider, change):
        super().apply(provider, change)
        return AppliedLimits({"global_rate": 20}, {"global_rate": 20, "reserve": 5})


def test_a_limits_change_is_audited_against_the_limits_its_write_replaced_not_an_earlier_read():
    """Given an operator's change of the reserve, and another operator's change of the global rate landing between
    a read of the limits and this change's write,
    When the change is made,
    Then its audit record's before is what its write replaced (global rate 20) (before: the API's earlier read, so
    the record also showed the rate going from 10 to 20, the other operator's change, as this one's)."""
    audit = Audit()
    put = _call(_operator_api(OperatorKeys(), audit, ChangedMeanwhile()), "PUT", "/v1/admin/limits/resend",
                json={"reserve": 5})
    assert put.status_code == 200, put.text
    assert audit.records == [("limits/resend", {"global_rate": 20, "reserve": 5})]
    assert audit.befores == [{"global_rate": 20}]


class LimitsAnswerLost(Limits):
    def apply(self, provider, change):
        super().apply(provider, change)
        raise StoreWriteUnknown("cannot write the limits of 'resend': Timeout reading from socket (test)")


class LimitsUnreadable(Limits):
    def apply(self, provider, change):
        raise StoreUnavailable("cannot read the limits of 'resend': Connection refused (test)")


def test_a_limits_change_whose_answer_was_lost_is_on_the_audit_trail_as_maybe_applied():
    """Given a Redis that runs a limits change and loses its answer (the operator log then holds the new limits),
    When the operator makes it,
    Then it is answered 503 `"outcome": "unknown"`, saying it may have been made (before: "unavailable, retry", as
    if nothing had changed: a rotated webhook secret the workers sign with was never shown to its tenant), and the
    audit trail has it as maybe applied, with what was asked (before: nothing; a retry, finding the new
    limits in place, recorded them as what they replaced, and without a retry the change was on no record)."""
    audit = Audit()
    put = _call(_operator_api(OperatorKeys(), audit, LimitsAnswerLost()), "PUT", "/v1/admin/limits/resend",
                json={"global_rate": 5, "global_burst": 10})
    assert put.status_code == 503 and put.json()["outcome"] == "unknown", put.text  # not "retry": it may be made
    assert "may have been made" in put.text
    assert audit.records == [("limits/resend", {"outcome": "unknown",
                                                "intended": {"global_rate": 5.0, "global_burst": 10}})]
    unread = _call(_operator_api(OperatorKeys(), audit, LimitsUnreadable()), "PUT", "/v1/admin/limits/resend",
                   json={"global_rate": 5, "global_burst": 10})
    assert unread.status_code == 503 and len(audit.records) == 1  # nothing was written: nothing to record
    assert "outcome" not in unread.json() and "retry after a moment" in unread.text


@pytest.mark.parametrize(("method", "path", "body", "field"), [
    ("POST", "/v1/admin/keys/abc/rotate", {"overlap": 0}, "overlap"),
    ("PUT", "/v1/admin/limits/resend", {"concurency": 2}, "concurency"),
    ("POST", "/v1/admin/keys", {"role": "tenant", "tenant": "acme", "lable": "x"}, "lable")])
def test_a_body_field_the_operator_api_does_not_know_is_refused_naming_it(method, path, body, field):
    """Given an operator,
    When a rotation asks for `overlap` (the CLI's option, not the API's `overlap_s`), or a limits change or a key
    carries a misspelt field,
    Then 422 names the field, and nothing is rotated, written or audited (before: a 201 rotation whose leaked key kept
    working 24 h, the default overlap; a 200 limits change that changed nothing)."""
    keys, audit, limits = OperatorKeys(), Audit(), Limits()
    r = _call(_operator_api(keys, audit, limits), method, path, json=body)
    assert r.status_code == 422 and field in r.text, r.text
    assert (keys.created, limits.applied, audit.records) == ([], [], [])


class RotationAnswerLost(OperatorKeys):
    def rotate(self, key_id, overlap_s):
        raise StoreWriteUnknown("cannot write API key abc: Timeout reading from socket (test)")


def test_a_key_rotation_whose_answer_redis_lost_is_answered_unknown_and_audited_as_maybe_applied():
    """Given a Redis that sets a key's end for its rotation and loses the answer,
    When the operator rotates the key,
    Then the answer is 503 `"outcome": "unknown"` and the audit trail has the rotation as maybe applied, with its
    overlap (before: "unavailable, retry" and no record, while the old key's end may have been set)."""
    audit = Audit()
    r = _call(_operator_api(RotationAnswerLost(), audit, Limits()), "POST", "/v1/admin/keys/abc/rotate",
              json={"overlap_s": 60})
    assert r.status_code == 503 and r.json()["outcome"] == "unknown", r.text
    assert audit.records == [("apikey/abc", {"outcome": "unknown", "intended": {"rotated": True, "overlap_s": 60}})]


@pytest.mark.parametrize("failure, says, outcome", [
    (PublishError("the replay of s1 was not published: Local: Broker transport failure (broker-3.internal:9092)"),
     "nothing was published", None),
    (ReplayOutcomeUnknown("the replay of s1 may have been published as r1 (Local: Message timed out at "
                          "broker-3.internal:9092)", "r1"), "may have been published as r1", "unknown"),
])
def test_a_replay_the_broker_failed_is_answered_without_the_brokers_own_words(monkeypatch, failure, says, outcome):
    """Given a broker that fails an operator's dead-letter replay, with nothing published or with its outcome unknown,
    When the operator replays (POST /v1/admin/dlq/{id}/replay),
    Then the 503 says which (naming the send id to look up when it may be out), and carries no broker address or
    client error text (before: the publisher's error, broker host and port included, was the answer's detail)."""
    def failing(*args, **kwargs):
        raise failure

    monkeypatch.setattr("streams.ingest.operator_api.replay_dead_letter_once", failing)
    ingest = _operator_api(OperatorKeys(), Audit(), Limits())
    ingest.webhooks, ingest.client.bootstrap = None, "broker-3.internal:9092"
    r = _call(ingest, "POST", "/v1/admin/dlq/s1/replay")
    assert r.status_code == 503 and says in r.text and r.json().get("outcome") == outcome, r.text
    assert "broker-3" not in r.text and "9092" not in r.text and "Local:" not in r.text, r.text


def test_a_reactivation_whose_answer_redis_lost_is_answered_unknown_and_audited_as_maybe_applied():
    """Given an endpoint a 410 disabled, and a Redis that writes its reactivation and loses the answer,
    When the operator reactivates it (POST /v1/admin/endpoints/{id}/reactivate),
    Then the answer is 503 `"outcome": "unknown"` and the audit trail has the reactivation as maybe applied, from
    disabled (before: no record at all; asked again, the endpoint read active, and the trail said active -> active:
    the lifted disable appeared nowhere)."""
    from streams.webhooks.model import Endpoint

    disabled = Endpoint("ep_1", "acme", "https://hooks.acme.test/in", ("*",), state="disabled",
                        state_reason="410 Gone")

    def set_active(tenant, endpoint_id):
        raise StoreWriteUnknown("cannot write endpoint ep_1: Timeout reading from socket (test)")

    audit = Audit()
    ingest = _operator_api(OperatorKeys(), audit, Limits())
    ingest.webhooks = SimpleNamespace(directory=SimpleNamespace(find=lambda endpoint_id, wait_s: disabled),
                                      endpoints=SimpleNamespace(get=lambda tenant, endpoint_id: disabled),
                                      current=lambda ep: ep, set_active=set_active)
    r = _call(ingest, "POST", "/v1/admin/endpoints/ep_1/reactivate")
    assert r.status_code == 503 and r.json()["outcome"] == "unknown", r.text
    assert audit.records == [("endpoint/ep_1", {"outcome": "unknown", "intended": {"state": "active"}})]
    assert audit.befores == [{"state": "disabled"}]
