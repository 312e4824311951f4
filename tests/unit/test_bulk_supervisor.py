"""The API's bulk process supervisor keeps starting the bulk process when a start itself fails."""

import errno
import subprocess
import sys

from streams.ingest import bulk
from tests.harness import wait_until


def test_a_bulk_process_that_cannot_be_started_is_started_again_later(monkeypatch, caplog):
    """Given a host out of processes for a moment (the first start fails with EAGAIN at the pod's pid limit),
    When the API's supervisor starts the bulk process,
    Then it says so and starts it again after its back-off (before: the error ended the supervising thread, and
    every batch got 503 for the API process's whole life, with no restart counted for the alert)."""
    started: list[subprocess.Popen] = []
    asked: list[list[str]] = []

    def start(argv, nice):
        asked.append(argv)
        if len(asked) == 1:
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        return started[-1]

    monkeypatch.setattr(bulk, "start_in_own_session", start)
    process = bulk.BulkProcess(nice=0)
    process.start()
    try:
        wait_until(lambda: started, 10, "the bulk process started after the failed start")
        assert "the bulk ingest process could not be started ([Errno 11] Resource temporarily unavailable)" \
            in caplog.text
    finally:
        process.stop()
    assert started[0].poll() is not None  # stopped with the API
