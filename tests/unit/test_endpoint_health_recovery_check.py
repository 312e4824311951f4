"""The endpoint-health app checks its table recovery from its start: faust's own timers start only once the
first recovery has completed, and a first recovery can wait for records faust dropped too."""

import asyncio

from streams.health.app import _App


def test_the_recovery_check_runs_while_the_first_recovery_has_not_completed():
    """Given the app's faust App with a first table recovery that never completes,
    When the app has started,
    Then the recovery check is already running (faust's timers and the ready banner are still waiting)."""

    async def scenario() -> None:
        app = _App("recovery-check-test", broker="kafka://127.0.0.1:1", store="memory://", web_enabled=False)
        checking, recovered = asyncio.Event(), asyncio.Event()

        async def check() -> None:
            checking.set()

        async def first_recovery() -> bool:
            await recovered.wait()  # never set
            return False

        app.while_recovering = check
        app._wait_for_table_recovery_completed = first_recovery  # type: ignore[method-assign]
        started = asyncio.ensure_future(app.on_started())
        await asyncio.wait_for(checking.wait(), 5)
        assert not started.done()
        started.cancel()

    asyncio.run(scenario())
