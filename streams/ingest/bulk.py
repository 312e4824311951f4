"""Batches served by a process of their own, at a lower CPU priority than single sends.

A tenant posting large batches at full speed keeps a process busy reading, validating, encoding and
publishing them. Served by the API process itself, that work holds its event loop and GIL, and every
other tenant's single sends wait behind it (measured: another tenant's single-send p99 went from
14 ms to 202 ms). So `streams api` starts a second copy of the same app, the *bulk process*, on a
Unix socket at nice `DUAL_RAIL_INGEST_BULK_NICE` (10 by default), and forwards every
`POST /v1/sends/batch` to it as it came (headers, Idempotency-Key and body), and its answer back as
it came. Where the two compete for a CPU, the kernel runs the single sends first. Both processes run
the same checks, keys, quotas and idempotency, so a batch means the same either way;
`DUAL_RAIL_INGEST_BULK=off` serves batches in the API process instead.

What can fail, and what the client is told:
- the bulk process is not running (starting, crashed, being restarted): 503 with Retry-After, and
  nothing was published; the API process starts it again, with backoff.
- it dies while publishing a batch: the batch's producer transaction is either committed or never
  will be (its successor takes the same transactional ids and aborts what was left open at start),
  and the API process cannot know which: 503 saying so; a retry with the same Idempotency-Key
  answers either way without publishing twice.
- the API process dies: the kernel stops the bulk process with it (PR_SET_PDEATHSIG).

Metrics: the bulk process's own are served at `/metrics/bulk` of the API's port.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from starlette.responses import JSONResponse, Response

from .. import metrics
from ..backoff import Outage

log = logging.getLogger("streams.api")

BATCH_PATH = "/v1/sends/batch"
METRICS_PATH = "/metrics/bulk"
# Headers that describe one hop of a connection, not the request or answer (RFC 9110 7.6.1), and the
# length, which the forwarding side sets again.
HOP_HEADERS = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade",
                         b"proxy-connection", b"content-length", b"host"})
PUBLISH_WAIT_S = 180.0  # longer than the bulk process ever takes to answer (its publish gives up after ~65 s)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    PR_SET_PDEATHSIG = 1  # noqa: N806 - the kernel's name
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class BulkProcess:
    """Starts the bulk process and starts it again whenever it exits, until `stop()`."""

    def __init__(self, nice: int, log_format: str | None = None):
        self._dir = Path(tempfile.mkdtemp(prefix="dual-rail-bulk-"))
        self.socket_path = str(self._dir / "bulk.sock")
        # Kept across restarts: a successor takes its predecessor's transactional ids (see module doc).
        self.instance = f"{socket.gethostname()}-{os.getpid()}-bulk"
        self.argv = ["nice", "-n", str(nice), sys.executable, "-m", "streams.cli",
                     *(["--log-format", log_format] if log_format else []),
                     "api", "--bulk-socket", self.socket_path, "--bulk-instance", self.instance]
        self._stopping = threading.Event()
        self._process: subprocess.Popen | None = None
        self._started = threading.Event()
        # Started and waited on by one thread: PR_SET_PDEATHSIG follows the thread that started the child.
        self._supervisor = threading.Thread(target=self._supervise, name="bulk-process", daemon=True)

    def start(self, ready_timeout_s: float = 60.0) -> None:
        """Start it and return once it answers (the API then opens its port with batches served)."""
        self._supervisor.start()
        self._started.wait(10)
        deadline = time.monotonic() + ready_timeout_s
        while not self._answers():
            if time.monotonic() > deadline or self._stopping.is_set():
                raise RuntimeError(f"the bulk ingest process did not answer on {self.socket_path} "
                                   f"within {ready_timeout_s:.0f} s (see its log lines above)")
            self._stopping.wait(0.05)  # start-up: polled, a few seconds at most

    def _answers(self) -> bool:
        try:
            with httpx.Client(transport=httpx.HTTPTransport(uds=self.socket_path), timeout=2) as client:
                client.get("http://bulk/openapi.json").raise_for_status()
            return True
        except httpx.HTTPError:
            return False

    def _supervise(self) -> None:
        outage = Outage("the bulk ingest process", base_s=0.5, cap_s=30.0)
        while not self._stopping.is_set():
            Path(self.socket_path).unlink(missing_ok=True)
            self._process = subprocess.Popen(self.argv, preexec_fn=_die_with_parent)  # noqa: S603, PLW1509
            self._started.set()
            started = time.monotonic()
            code = self._process.wait()
            if self._stopping.is_set():
                return
            metrics.INGEST_BULK_RESTARTS.inc()
            if time.monotonic() - started > 60:  # it ran a while: a new episode, not a crash loop
                outage.recovered(time.monotonic())
            outage.failed(time.monotonic(), f"exited with {code}")
            self._stopping.wait(max(0.0, outage.next_try_at - time.monotonic()))

    def stop(self) -> None:
        self._stopping.set()
        process = self._process
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._supervisor.join(5)
        shutil.rmtree(self._dir, ignore_errors=True)


def unavailable(message: str) -> JSONResponse:
    metrics.INGEST_REJECTED.labels("503").inc()
    return JSONResponse({"error": "unavailable", "errors": [{"loc": [], "msg": message}]}, status_code=503,
                        headers={"Retry-After": "1"})


class BulkProxy:
    """ASGI: `POST /v1/sends/batch` (and `/metrics/bulk`) answered by the bulk process; the rest by `app`."""

    def __init__(self, app, socket_path: str):
        self.app = app
        self.socket_path = socket_path
        self._client: httpx.AsyncClient | None = None

    def client(self) -> httpx.AsyncClient:
        if self._client is None:  # made on the server's event loop, on first use
            self._client = httpx.AsyncClient(
                base_url="http://bulk", transport=httpx.AsyncHTTPTransport(uds=self.socket_path),
                timeout=httpx.Timeout(PUBLISH_WAIT_S, connect=2.0), limits=httpx.Limits(max_connections=None))
        return self._client

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["method"] == "POST" and scope["path"] == BATCH_PATH:
            return await self._forward(scope, receive, send)
        if scope["method"] == "GET" and scope["path"] == METRICS_PATH:
            return await self._metrics(scope, receive, send)
        return await self.app(scope, receive, send)

    async def _forward(self, scope, receive, send) -> None:
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in HOP_HEADERS]
        query = scope.get("query_string", b"").decode("latin-1")
        try:
            answer = await self.client().post(BATCH_PATH + (f"?{query}" if query else ""), content=b"".join(chunks),
                                              headers=headers)
        except (httpx.ConnectError, httpx.ConnectTimeout):
            response: Response = unavailable("the bulk ingest process is not running (it is being started again): "
                                             "nothing was published; retry after a moment")
        except httpx.HTTPError as exc:
            log.warning("the bulk ingest process did not answer a batch (%s)", type(exc).__name__)
            response = unavailable("the bulk ingest process stopped while publishing this batch: it may or may "
                                   "not have been published; retry with the same Idempotency-Key to find out "
                                   "without publishing it twice")
        else:
            response = Response(answer.content, answer.status_code,
                                headers={k: v for k, v in answer.headers.items()
                                         if k.encode().lower() not in HOP_HEADERS})
        await response(scope, receive, send)

    async def _metrics(self, scope, receive, send) -> None:
        try:
            answer = await self.client().get("/metrics/")  # the app mounts its exposition at /metrics/
            response: Response = Response(answer.content, answer.status_code,
                                          media_type=answer.headers.get("content-type"))
        except httpx.HTTPError:
            response = unavailable("the bulk ingest process is not running")
        await response(scope, receive, send)
