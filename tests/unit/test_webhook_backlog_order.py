"""An endpoint's backlog counts a delivery before it is published, and not at all when the broker refuses it whole.
Counted after the publish, a delivery the worker delivered (and the outcome recorder took out of the backlog)
before the API got to count it stayed counted for 3 days: on a busy endpoint such strays can reach the shedding
thresholds, and a healthy endpoint's new events are then skipped. The app in this process, with fakes for the
broker and the webhook state (no Redis)."""

import asyncio
from types import SimpleNamespace

import httpx
import orjson

from streams.errors import PublishError, StoreUnavailable
from streams.ingest.api import Ingest, create_app
from streams.ingest.api_keys import Principal
from streams.ingest.publisher import Written
from streams.ingest.sdk import SendClient
from streams.names import TopicNames
from streams.outcomes import events_of
from streams.webhooks.model import Endpoint
from tests.harness import webhook_event


class Keys:
    def resolve(self, token: str):
        return Principal("tenant", "acme", "key-1")

    def touch(self, *args, **kwargs):
        pass


class Webhooks:
    """One endpoint subscribed; every delivery admitted; what happens to the backlog is noted in `steps`."""

    def __init__(self, steps: list[str]):
        self.steps = steps
        self.endpoints = SimpleNamespace(subscribers=lambda tenant, event_type: [
            Endpoint("ep_1", "acme", "https://example.com/hook", ("invoice.paid",))])

    def sync_view(self):
        pass

    def admit(self, deliveries, disabled=frozenset()):
        return deliveries, []

    def enqueued(self, deliveries):
        self.steps.append(f"counted {len(deliveries)}")

    def withdrawn(self, deliveries):
        self.steps.append(f"withdrawn {len(deliveries)}")


class Broker:
    def __init__(self, steps: list[str], refuse: bool):
        self.steps, self.refuse = steps, refuse

    async def publish_async(self, records):
        if self.refuse:
            raise PublishError("refused whole (test)")
        self.steps.append("published")
        return [SimpleNamespace(partition=0, offset=i) for i in range(len(records))]


def _post_event(refuse: bool) -> tuple[int, list[str]]:
    steps: list[str] = []
    client = SendClient("127.0.0.1:1", TopicNames("t."))
    client.publisher.close()
    client.publisher = Broker(steps, refuse)  # type: ignore[assignment]
    store = SimpleNamespace(accepted=lambda sends: None, record_outcome=lambda event: None)
    ingest = Ingest(client=client, store=store, keys=Keys(), limits=None, known_policies=frozenset(),  # type: ignore[arg-type]
                    webhooks=Webhooks(steps))  # type: ignore[arg-type]
    transport = httpx.ASGITransport(create_app(ingest), raise_app_exceptions=False)

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as http:
            return await http.post("/v1/sends", json=webhook_event(), headers={"Authorization": "Bearer dr_ten_x"})

    return asyncio.run(call()).status_code, steps


def test_a_delivery_is_counted_in_its_endpoints_backlog_before_it_is_published():
    status, steps = _post_event(refuse=False)
    assert status == 202 and steps == ["counted 1", "published"]


def test_a_delivery_the_broker_refuses_whole_is_not_left_in_the_backlog():
    status, steps = _post_event(refuse=True)
    assert status == 503 and steps == ["counted 1", "withdrawn 1"]


class Shedding(Webhooks):
    """The endpoint's backlog is over its limit: every delivery is skipped (never enqueued)."""

    def admit(self, deliveries, disabled=frozenset()):
        return [], [(d, "backlog_shed") for d in deliveries]


class OutcomesRefused(Broker):
    """Takes the skipped delivery's payload (notif.webhook.skipped); refuses its outcome; keeps what is published
    without waiting."""

    def __init__(self, steps):
        super().__init__(steps, refuse=False)
        self.unwaited: list = []

    async def publish_async(self, records):
        return [Written(r.topic, 0, i) for i, r in enumerate(records)]

    def publish(self, records):
        raise PublishError("the outcome record was refused (test)")

    def publish_unwaited(self, records):
        self.unwaited += records


def test_a_skipped_delivery_whose_outcome_and_status_both_fail_is_recorded_through_the_outcomes_topic_again():
    """Given an endpoint whose deliveries are skipped (its backlog shed), a broker that refuses the skipped
    delivery's outcome record, and a state store that fails to record its status,
    When an event is posted (answered 202, naming the delivery),
    Then the delivery's `skipped` outcome is published again, without waiting, for the outcome recorder to record
    (before: only sends' `accepted` events were; the skipped delivery had no status anywhere: 404, and no bulk
    replay found it)."""
    steps: list[str] = []
    client = SendClient("127.0.0.1:1", TopicNames("t."))
    client.publisher.close()
    broker = OutcomesRefused(steps)
    client.publisher = broker  # type: ignore[assignment]

    def down(*args):
        raise StoreUnavailable("recording statuses: Redis unavailable (test)")

    ingest = Ingest(client=client, store=SimpleNamespace(accepted=down, record_outcome=down), keys=Keys(),  # type: ignore[arg-type]
                    limits=None, known_policies=frozenset(), webhooks=Shedding(steps))  # type: ignore[arg-type]
    transport = httpx.ASGITransport(create_app(ingest), raise_app_exceptions=False)

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as http:
            return await http.post("/v1/sends", json=webhook_event(), headers={"Authorization": "Bearer dr_ten_x"})

    answer = asyncio.run(call())
    assert answer.status_code == 202, answer.text
    events = [e for r in broker.unwaited for e in events_of(orjson.loads(r.value))]
    assert [(e["status"], e["reason"]) for e in events] == [("skipped", "backlog_shed")]
