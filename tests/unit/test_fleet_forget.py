"""A benchmark's fleet forgets its namespace (topics and Redis keys) when it ends, as far as it can."""

import pytest

from streams.devtools.fleet import Fleet


def test_a_store_that_went_away_is_reported_and_does_not_hide_the_run(tmp_path, monkeypatch, capsys):
    """Given a benchmark fleet whose Redis is gone when it ends,
    When it exits (after its run, or with the run's own error),
    Then it still deletes its topics, says which keys it could not delete and how to clear them, and the run's
    own error is the one raised."""
    fleet = Fleet("bench1.", tmp_path / "logs", forget=True)
    deleted = []

    def redis_gone() -> int:
        raise ConnectionError("Error 111 connecting to 127.0.0.1:16379")

    monkeypatch.setattr(fleet, "delete_keys", redis_gone)
    monkeypatch.setattr(fleet, "delete_topics", lambda: deleted.append("topics") or 25)
    with pytest.raises(RuntimeError, match="the run's own error"):
        with fleet:
            raise RuntimeError("the run's own error")
    assert deleted == ["topics"]
    err = capsys.readouterr().err
    assert "could not delete the Redis keys of namespace 'bench1.'" in err and "start with 'bench1.'" in err


@pytest.mark.parametrize("namespace", ["", "bench1", "notif.", "*.", "a.b."])
def test_a_namespace_that_could_take_others_with_it_is_refused(namespace, tmp_path):
    """Forgetting deletes every topic and key whose name starts with the namespace: without its dot "bench1" would
    take "bench10." with it, "" or "notif." the stack's own topics, and "*" is a Redis key pattern."""
    with pytest.raises(ValueError, match="namespace"):
        Fleet(namespace, tmp_path / "logs", forget=True)
