"""The mock's second SMS protocol (short-lived bearer tokens) scopes idempotency keys as providers do: by account."""

import asyncio

import httpx

from streams.devtools.mock_provider import CLIENT, MockConfig, build_app


def test_a_request_sent_again_under_a_refreshed_token_is_answered_from_the_providers_store():
    """Given the token provider, a client that took a token and sent an SMS under an idempotency key,
    When it takes a new token (the first one about to lapse) and sends the same request under the same key,
    Then the answer is the first one, replayed, status and all, and one SMS is delivered (before: the mock scoped
    keys by the token, so dispatch's re-send of a request whose answer was lost, after a token refresh, was a
    second SMS, though providers scope idempotency keys by account and dispatch declares this one idempotent)."""
    body = {"destination": "+15555550100", "text": "code 123456", "metadata": {"send_id": "s-1", "tenant": "acme"}}

    async def scenario() -> tuple[list[httpx.Response], dict]:
        transport = httpx.ASGITransport(app=build_app(MockConfig(rate=100)))
        async with httpx.AsyncClient(transport=transport, base_url="http://mock") as client:
            answers = []
            for _ in range(2):
                token = (await client.post("/oauth/token", json={"client_id": CLIENT[0],
                                                                 "client_secret": CLIENT[1]})).json()
                answers.append(await client.post("/v2/messages", json=body, headers={
                    "Authorization": f"Bearer {token['access_token']}", "Idempotency-Key": "send-s-1"}))
            return answers, (await client.get("/_mock/stats")).json()

    answers, stats = asyncio.run(scenario())
    assert [a.status_code for a in answers] == [201, 201] and answers[0].json() == answers[1].json()
    assert (stats["messages_delivered"], stats["idempotent_replays"], stats["duplicate_deliveries"]) == (1, 1, 0)
