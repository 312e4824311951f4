"""A webhook receiver's 410 Gone disables its endpoint without holding the worker's poll thread."""

import threading
from types import SimpleNamespace

from streams.dispatch.requests import Job
from streams.errors import PublishOutcomeUnknown
from streams.providers.outcome import ProviderResult
from streams.webhooks.gone import GoneEndpoints
from streams.webhooks.model import Endpoint

URL = "https://hooks.acme.example/in"


class SlowBroker:
    """Endpoints whose disabling waits for the broker (the operator log's write) until `answer` is set, then fails
    as a broker that never confirmed does, or succeeds."""

    def __init__(self, fail: bool):
        self.endpoints = {"ep_1": Endpoint("ep_1", "acme", URL, ("*",))}
        self.answer, self.fail, self.asked = threading.Event(), fail, 0

    def get(self, tenant, endpoint_id):
        return self.endpoints.get(endpoint_id)

    def disable_gone(self, tenant, endpoint_id, url):
        self.asked += 1
        self.answer.wait()
        if self.fail:
            raise PublishOutcomeUnknown("the broker did not confirm the write")
        self.endpoints[endpoint_id] = Endpoint(endpoint_id, tenant, url, ("*",), state="disabled")
        return self.endpoints[endpoint_id]


def gone(target: str = URL) -> tuple[Job, ProviderResult]:
    member = SimpleNamespace(send=SimpleNamespace(payload={"endpoint_id": "ep_1"}))
    job = Job("k", "ep_1", b"", "acme", ("send-1",), [member])  # type: ignore[list-item]
    return job, ProviderResult("gone", 410, error_name="gone", target=target)


def test_a_410_while_the_broker_is_away_holds_nothing_and_disables_once_asked_again_later():
    """Given an endpoint whose disabling waits for a broker that is away,
    When its receiver answers 410 three times (three deliveries in flight),
    Then each answer is settled at once (before: the poll thread waited for the broker, up to 20 s an answer, and
    every tenant's deliveries on that worker with it), the endpoint is disabled once at a time; a failed disabling
    is asked again at the next 410."""
    store = SlowBroker(fail=True)
    disable = GoneEndpoints(store)
    assert [disable(*gone()) for _ in range(3)] == [True, True, True]
    store.answer.set()
    disable.wait()
    assert store.asked == 1 and store.endpoints["ep_1"].state == "active"

    store.fail = False
    assert disable(*gone())
    disable.wait()
    assert store.asked == 2 and store.endpoints["ep_1"].state == "disabled"
    assert disable(*gone()) and store.asked == 2  # disabled: nothing more to do
    # Its URL changed since (it stays disabled): a 410 from the old one does not speak for it, retried at the new
    store.endpoints["ep_1"] = Endpoint("ep_1", "acme", "https://new.acme.example/in", ("*",), state="disabled")
    assert disable(*gone()) is False


def test_a_410_from_the_url_the_endpoint_no_longer_has_does_not_disable_it():
    """Given an endpoint whose URL was changed while a delivery to the old one was on its way,
    When the old URL answers 410, Then the answer does not speak for the endpoint (False: retried at the new URL)
    and nothing is disabled."""
    store = SlowBroker(fail=False)
    store.answer.set()
    disable = GoneEndpoints(store)
    assert disable(*gone("https://old.acme.example/in")) is False
    disable.wait()
    assert store.asked == 0 and store.endpoints["ep_1"].state == "active"
