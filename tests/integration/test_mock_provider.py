"""The mock provider behaves like the outside world it stands for."""

import orjson

from tests.harness import local_client

AUTH = {"Authorization": "Bearer re_team_key"}
EMAIL = {"from": "a@acme.test", "to": ["b@example.test"], "subject": "s", "text": "t",
         "tags": [{"name": "send_id", "value": "s-1"}, {"name": "tenant", "value": "acme"}]}


def test_team_limit_answers_429_with_resend_headers(mock_provider):
    """Given the mock provider limited to 3 requests a second,
    When 6 emails are posted in quick succession, each with its own idempotency key,
    Then at least 2 are answered 429 rate_limit_exceeded, with the ratelimit-limit, ratelimit-remaining,
    ratelimit-reset and retry-after headers Resend sends."""
    mock_provider.reset(rate=3)
    c = local_client(base_url=mock_provider.url)
    answers = [c.post("/emails", json=EMAIL, headers={**AUTH, "Idempotency-Key": f"k{i}"}) for i in range(6)]
    throttled = [r for r in answers if r.status_code == 429]
    assert len(throttled) >= 2
    r = throttled[0]
    assert r.json()["name"] == "rate_limit_exceeded"
    assert {"ratelimit-limit", "ratelimit-remaining", "ratelimit-reset", "retry-after"} <= set(r.headers)


def test_batch_rules_are_strict(mock_provider):
    """Given the mock provider,
    When a batch of 101 emails, a batch with one invalid address, a batch with an attachment and a batch with a tag
    value holding a dot are posted, and afterwards a batch of 100 valid emails,
    Then the first four are rejected with 422 without delivering anything, and the batch of 100 is accepted (200)."""
    c = local_client(base_url=mock_provider.url)
    assert c.post("/emails/batch", json=[EMAIL] * 101, headers=AUTH).status_code == 422
    one_bad = [EMAIL, {**EMAIL, "to": ["nope"]}]
    assert c.post("/emails/batch", json=one_bad, headers=AUTH).status_code == 422
    with_attachment = [{**EMAIL, "attachments": [{"filename": "a.txt"}]}]
    assert c.post("/emails/batch", json=with_attachment, headers=AUTH).status_code == 422
    dotted_tenant = [{**EMAIL, "tags": [{"name": "tenant", "value": "acme.eu"}]}]  # Resend's tag rule
    assert c.post("/emails/batch", json=dotted_tenant, headers=AUTH).status_code == 422
    assert mock_provider.stats()["messages_delivered"] == 0
    assert c.post("/emails/batch", json=[EMAIL] * 100, headers=AUTH).status_code == 200


def test_idempotency_key_replays_same_body_and_refuses_a_different_one(mock_provider):
    """Given the mock provider and one idempotency key,
    When the same email is posted twice under that key, and then a changed email under it,
    Then the repeat gets the identical 200 answer, the changed body gets 409 invalid_idempotent_request, and only one
    email is delivered (one idempotent replay)."""
    c = local_client(base_url=mock_provider.url)
    h = {**AUTH, "Idempotency-Key": "send-s-1"}
    first = c.post("/emails", content=orjson.dumps(EMAIL), headers=h)
    again = c.post("/emails", content=orjson.dumps(EMAIL), headers=h)
    assert first.status_code == again.status_code == 200 and first.json() == again.json()
    other = c.post("/emails", content=orjson.dumps({**EMAIL, "subject": "changed"}), headers=h)
    assert other.status_code == 409 and other.json()["name"] == "invalid_idempotent_request"
    stats = mock_provider.stats()
    assert stats["messages_delivered"] == 1 and stats["idempotent_replays"] == 1


def test_faults_and_auth(mock_provider):
    """Given the mock provider,
    When an email is posted without an API key, one with a header that is no key, and another with a key while every
    request is set to fail with a 5xx,
    Then the first gets 401 missing_api_key, the second 400 validation_error "API key is invalid" (as Resend answers
    both), and the third 500."""
    c = local_client(base_url=mock_provider.url)
    r = c.post("/emails", json=EMAIL)
    assert r.status_code == 401 and r.json()["name"] == "missing_api_key"
    r = c.post("/emails", json=EMAIL, headers={"Authorization": "Bearer not-a-key"})
    assert r.status_code == 400 and (r.json()["name"], r.json()["message"]) == ("validation_error", "API key is invalid")
    mock_provider.configure(fault_5xx_ratio=1.0)
    assert c.post("/emails", json=EMAIL, headers=AUTH).status_code == 500


def test_the_tests_clients_let_an_idle_connection_go_before_the_local_servers_do(mock_provider):
    """Given the mock provider (uvicorn: it closes a connection idle for 5 s) and a test client,
    When both a raw connection and the client sit idle past the client's keep-alive,
    Then the server still holds the raw connection open, and the client's next request opens a new
    connection: it never sends on one the server may be closing at that moment (a request lost that way
    failed a CI run with "Server disconnected without sending a response")."""
    import socket
    import time

    from streams.devtools.fleet import LOCAL_KEEPALIVE_S

    connects: list[str] = []
    client = local_client(base_url=mock_provider.url, timeout=10)

    def stats() -> int:
        return client.get("/_mock/stats", extensions={"trace": lambda event, info: connects.append(event)
                                                      if event == "connection.connect_tcp.started" else None}
                          ).status_code

    raw = socket.create_connection(("127.0.0.1", int(mock_provider.url.rsplit(":", 1)[1])), timeout=10)
    raw.sendall(b"GET /_mock/stats HTTP/1.1\r\nHost: mock\r\n\r\n")
    answer = raw.makefile("rb")
    assert answer.readline().startswith(b"HTTP/1.1 200")
    length = 0
    while (line := answer.readline()) != b"\r\n":
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    answer.read(length)  # the whole answer: nothing is left to read on the connection
    assert stats() == 200 and len(connects) == 1
    time.sleep(LOCAL_KEEPALIVE_S + 0.5)  # the idle time is what is tested, not a wait for something
    raw.setblocking(False)
    try:
        raw.recv(1)
        raise AssertionError("the server closed an idle connection before the tests' clients let theirs go")
    except BlockingIOError:
        pass  # open, with nothing to read
    finally:
        answer.close()
        raw.close()
    assert stats() == 200 and len(connects) == 2
    client.close()
