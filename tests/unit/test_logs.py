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
