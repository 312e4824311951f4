"""What the endpoint view remembers of deleted endpoints: the endpoint-health app removes their rows with it."""

import orjson

from streams.webhooks.endpoints import EndpointDirectory
from streams.webhooks.model import Endpoint


def _applied(directory: EndpointDirectory, key: str, value: bytes | None) -> dict:
    endpoints = dict(directory.endpoints)
    directory._apply(directory.topic, key, value, endpoints, {}, {})
    directory.endpoints = endpoints
    return endpoints


def test_a_deleted_endpoint_is_remembered_for_a_while_and_only_by_a_view_asked_to():
    """Given a view asked to remember deletions for an hour, and one not asked,
    When the operator log creates an endpoint, deletes it, and deletes another one an hour and more ago,
    Then the first view names the endpoint deleted lately (not the older one, forgotten), and forgets it if the
    log holds an endpoint of that id again; the other view remembers nothing."""
    ep = Endpoint("ep_1", "acme", "https://example.test/hook", ("*",))
    remembering = EndpointDirectory("unused:9092", "operator-log", remember_deleted_s=3600.0)
    forgetting = EndpointDirectory("unused:9092", "operator-log")
    for view in (remembering, forgetting):
        _applied(view, "endpoint/ep_1", orjson.dumps(ep.to_doc()))
        _applied(view, "endpoint/ep_1", None)
    assert "ep_1" not in remembering.endpoints and remembering.recently_deleted() == ["ep_1"]
    assert forgetting.recently_deleted() == [] and forgetting.deleted == {}

    _applied(remembering, "endpoint/ep_old", None)
    remembering.deleted["ep_old"] -= 3601.0  # seen deleted more than an hour ago
    assert remembering.recently_deleted() == ["ep_1"] and "ep_old" not in remembering.deleted

    _applied(remembering, "endpoint/ep_1", orjson.dumps(ep.to_doc()))
    assert remembering.recently_deleted() == []
