"""Evidence lines as text and as JSON (`--log-format json`)."""

import logging

import orjson

from streams import logs


def test_evidence_lines_carry_their_fields_as_text_and_as_json(capsys, monkeypatch):
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))  # restored after the test
    monkeypatch.setattr(root, "level", root.level)
    log = logging.getLogger("streams.test")
    logs.setup("INFO", "json")
    logs.evidence(log, logging.WARNING, "attempt_failed", send_id="s-1", status=429, error="rate_limit_exceeded",
                  body=None)
    line = orjson.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert line["msg"].startswith("attempt_failed send_id=s-1 status=429") and line["level"] == "WARNING"
    assert line["event"] == "attempt_failed" and line["send_id"] == "s-1" and line["status"] == 429

    logs.setup("INFO", "text")
    logs.evidence(log, logging.WARNING, "dead_lettered", send_id="s-2", reason="too_old")
    assert "WARNING streams.test dead_lettered send_id=s-2 reason=too_old" in capsys.readouterr().err


def test_an_evidence_value_can_neither_make_fields_nor_lines_nor_stand_for_the_lines_own_keys(capsys, monkeypatch):
    """Given a failed attempt whose provider answered a body holding a space, `=`, a quote and a line break that
    reads like a log line of its own, and fields named `ts` and `msg`,
    When it is logged as text and as JSON,
    Then the text line stays one line, the body one quoted field (before: `status=200` and a forged second line
    came out of it), and the JSON line's own `ts` and `msg` stay the record's (before: the fields overwrote them)."""
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))
    monkeypatch.setattr(root, "level", root.level)
    log = logging.getLogger("streams.test")
    body = 'bad request status=200\n2026-12-06 INFO streams.settle delivered send_id=forged "x"'
    logs.setup("INFO", "text")
    logs.evidence(log, logging.WARNING, "attempt_failed", send_id="s-1", body=body, status=400)
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.endswith('attempt_failed send_id=s-1 body=' + orjson.dumps(body).decode() + " status=400")
    logs.setup("INFO", "json")
    logs.evidence(log, logging.WARNING, "attempt_failed", send_id="s-1", ts="forged", msg="forged")
    doc = orjson.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert isinstance(doc["ts"], float) and doc["msg"].startswith("attempt_failed send_id=s-1")


def _failed_sending(recipient: str) -> Exception:
    """A bug's exception naming a recipient, raised from a Redis error (whose text is the server's own)."""
    from redis.exceptions import ResponseError

    try:
        try:
            raise ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")
        except ResponseError as cause:
            raise KeyError(f"no template for {recipient}") from cause
    except KeyError as exc:
        return exc


def test_a_logged_traceback_shows_where_and_what_but_not_the_text_of_what_code_was_handling(capsys, monkeypatch):
    """Given an exception whose text names a recipient (a bug's KeyError), raised from a Redis error,
    When it is logged with its traceback, as text and as JSON, from this project's logger and from the API server's
    (uvicorn, run with this project's UVICORN_LOGGING),
    Then each line shows both exceptions' classes and frames, the Redis error's text, and never the recipient
    (before: the traceback carried the exception's text, and uvicorn logged through handlers of its own)."""
    import uvicorn

    from streams.cli.roles import UVICORN_LOGGING

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))
    monkeypatch.setattr(root, "level", root.level)
    exc = _failed_sending("jane@example.test")
    for fmt in ("text", "json"):
        logs.setup("INFO", fmt)
        uvicorn.Config(app=None, **UVICORN_LOGGING).configure_logging()
        logging.getLogger("streams.test").error("sending failed", exc_info=exc)
        logging.getLogger("uvicorn.error").error("Exception in ASGI application", exc_info=exc)
        err = capsys.readouterr().err
        shown = err if fmt == "text" else "\n".join(orjson.loads(line)["exc"] for line in err.splitlines())
        assert "jane@example.test" not in err
        for both in ("builtins.KeyError: (its text withheld)\nwhich was raised from:\n",
                     'raise KeyError(f"no template for {recipient}") from cause',
                     "redis.exceptions.ResponseError: WRONGTYPE Operation against a key"):
            assert shown.count(both) == 2, (fmt, both, shown)


class ClientTimeout(TimeoutError):
    """An HTTP client library's own timeout (an OSError), whose text names the URL it called."""


def test_an_os_error_shows_its_text_only_when_the_operating_system_wrote_it():
    """Given a connection refused (the standard library's OSError), an HTTP client's timeout naming a webhook URL
    (an OSError of the library's own class), and an exception group holding both,
    When their tracebacks are shown,
    Then the connection refused keeps its text, the timeout's URL is withheld, and the group names what it holds
    (before: every OSError's text was shown, a webhook URL's token with it)."""
    refused = ConnectionRefusedError(111, "Connection refused")
    timeout = ClientTimeout("Connection timeout to host https://hooks.example/T0/s3cret")
    assert logs.traceback_shown(refused).endswith("builtins.ConnectionRefusedError: [Errno 111] Connection refused")
    assert logs.traceback_shown(timeout).endswith("ClientTimeout: (its text withheld)")
    group = logs.traceback_shown(ExceptionGroup("two failed", [refused, timeout]))
    assert group.endswith("(holding ConnectionRefusedError, ClientTimeout)") and "s3cret" not in group
