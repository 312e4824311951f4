"""A receiver that answers 410 Gone asks not to be called again: its endpoint is disabled. The webhook worker
asks on its poll thread, as it settles the answer; the disabling itself (the operator log, then Redis) goes on a
thread of its own, so a broker that is slow or away (each write waits for it, up to its message timeout) holds
no other tenant's deliveries, lease refreshes or rebalance callbacks meanwhile."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
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
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="disable-gone")

    def __call__(self, job: Job, result: ProviderResult) -> bool:
        endpoint_id = job.members[0].send.payload["endpoint_id"]
        try:
            current = self.store.get(job.tenant, endpoint_id)
        except StoreUnavailable as exc:  # the receiver says so again on the next delivery
            log.warning("endpoint %s answered 410 Gone but could not be read to disable it: %s", endpoint_id, exc)
            return True
        if current is None or current.state == "disabled":
            return True
        if current.url != result.target:
            return False
        with self._lock:
            if endpoint_id in self._disabling:
                return True
            self._disabling.add(endpoint_id)
        self._thread.submit(self._disable, job.tenant, endpoint_id, result.target)
        return True

    def _disable(self, tenant: str, endpoint_id: str, url: str) -> None:
        try:
            self.store.disable_gone(tenant, endpoint_id, url)
        except (PublishError, StoreUnavailable) as exc:  # the receiver says so again on the next delivery
            log.warning("endpoint %s answered 410 Gone but could not be disabled now: %s", endpoint_id, exc)
        except Exception:  # noqa: BLE001 - never the worker's failure: logged, asked again at the next 410
            log.exception("disabling endpoint %s after its 410 Gone failed", endpoint_id)
        finally:
            with self._lock:
                self._disabling.discard(endpoint_id)

    def wait(self) -> None:
        """Until every disabling asked for so far is done (for tests and shutdown)."""
        self._thread.submit(lambda: None).result()
