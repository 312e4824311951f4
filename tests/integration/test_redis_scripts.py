"""Scripts in pipelines on a real Redis: one round trip, and a flushed script cache costs nothing twice."""

import uuid

from streams.redis_client import connect

COUNT = "local n = redis.call('INCR', KEYS[1]) return n"


def _script_exists_calls(client) -> int:
    return int(client.info("commandstats").get("cmdstat_script|exists", {}).get("calls", 0))


def test_pipelined_scripts_skip_script_exists_and_survive_a_flushed_cache(stack):
    """Given a client of the project and a script registered on it,
    When pipelines run it (with a plain INCR beside it), then Redis's script cache is flushed (as a restart does)
    and another pipeline runs it,
    Then no pipeline asked SCRIPT EXISTS, the pipeline after the flush still answers every command, and every
    command ran exactly once (the counters say 1, 2, 3 and the plain INCR's key 3)."""
    client = connect(stack.redis_url)
    counter, plain = f"t:{uuid.uuid4().hex}:scripted", f"t:{uuid.uuid4().hex}:plain"
    script = client.register_script(COUNT)
    exists_before = _script_exists_calls(client)

    answers = []
    for flush in (False, False, True):
        if flush:
            client.script_flush()
        pipe = client.pipeline(transaction=False)
        script(keys=[counter], client=pipe)
        pipe.incr(plain)
        answers.append(pipe.execute())

    assert answers == [[1, 1], [2, 2], [3, 3]]
    assert int(client.get(counter)) == 3 and int(client.get(plain)) == 3
    assert _script_exists_calls(client) == exists_before
    client.delete(counter, plain)
