"""A receiver that answers 410 Gone asks not to be called again: its endpoint is disabled. The webhook worker
asks on its poll thread, as it settles the answer; the disabling itself (the operator log, then Redis) goes on a
thread of its own, so a broker that is slow or away (each write waits for it, up to its message timeout) holds
no other tenant's deliveries, lease refreshes or rebalance callbacks meanwhile."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Protocol

from ..dispatch.requests import Job
from ..errors import PublishError, StoreUnavailable
from ..providers.outcome import ProviderResult
from .model import Endpoint

log = logging.getLogger("streams.webhooks")


class Endpoints(Protocol):
    def get(self, tenant: str, endpoint_id: str) -> Endpoint | None: ...
    def disable_gone(self, tenant: str, endpoint_id: str, url: str) -> Endpoint | None: ...


class GoneEndpoints:
    """`gone(job, result)`: whether a 410 speaks for the endpoint (False: the endpoint has another URL by now, the
    answer was the old one's); when it does, the endpoint is disabled in the background, once at a time each."""

    def __init__(self, store: Endpoints):
        self.store = store
        self._disabling: set[str] = set()
        self._lock = threading.Lock()
        # A daemon thread: a worker stopping does not wait for a disabling held by a broker that is away (the
        # receiver says 410 again at the next delivery, and it is asked again then).
        self._asked: queue.Queue[tuple[str, str, str]] = queue.Queue()
        threading.Thread(target=self._run, name="disable-gone", daemon=True).start()

    def __call__(self, job: Job, result: ProviderResult) -> bool:
        endpoint_id = job.members[0].send.payload["endpoint_id"]
        try:
            current = self.store.get(job.tenant, endpoint_id)
        except StoreUnavailable as exc:  # the receiver says so again on the next delivery
            log.warning("endpoint %s answered 410 Gone but could not be read to disable it: %s", endpoint_id, exc)
            return True
        if current is None:
            return True
        if current.url != result.target:  # also for a disabled one: the delivery is retried at its new URL
            return False
        if current.state == "disabled":
            return True
        with self._lock:
            if endpoint_id in self._disabling:
                return True
            self._disabling.add(endpoint_id)
        self._asked.put((job.tenant, endpoint_id, result.target))
        return True

    def _run(self) -> None:
        while True:
            tenant, endpoint_id, url = self._asked.get()
            try:
                self.store.disable_gone(tenant, endpoint_id, url)
            except (PublishError, StoreUnavailable) as exc:  # the receiver says so again on the next delivery
                log.warning("endpoint %s answered 410 Gone but could not be disabled now: %s", endpoint_id, exc)
            except Exception:  # noqa: BLE001 - never the worker's failure: logged, asked again at the next 410
                log.exception("disabling endpoint %s after its 410 Gone failed", endpoint_id)
            finally:
                with self._lock:
                    self._disabling.discard(endpoint_id)
                self._asked.task_done()

    def wait(self) -> None:
        """Until every disabling asked for so far is done (for tests)."""
        self._asked.join()
