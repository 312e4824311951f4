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
  and the API process cannot know which: 503 saying so. A retry with the same Idempotency-Key gets
  the original answer, or (once the key's 60 s lease has passed) publishes the batch again under
  the same send ids, which dispatch sends at most once.
- it stops answering (hung, its socket removed): the API process asks it every 5 s and, after 3
  unanswered probes in a row, kills it; it is then started again like a crashed one.
- it takes longer than PUBLISH_WAIT_S: 503 saying it may still publish the batch (same advice).
- the endpoint view: both processes follow the endpoint topics, each a moment apart. Before a batch
  of webhook events is fanned out, the bulk process brings its view up to the topics' ends (at most
  BULK_VIEW_SYNC_S), so an endpoint the API process has shown as active again gets the deliveries.
- the API process dies: the kernel stops the bulk process with it (PR_SET_PDEATHSIG, set by the
  bulk process itself at start), and the bulk process removes its socket's directory on its way out.

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
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse

from .. import metrics
from ..backoff import Outage
from ..cpu_priority import start_in_own_session
from ..errors import PublishError, StoreUnavailable
from .api_keys import Principal
from .unix_http import Answer, Interrupted, UnixHttp, Unreachable
from .web import (
    NO_VALID_KEY,
    NOT_A_TENANT_KEY,
    bearer_token,
    earlier_attempt_may_be_published,
    first_header,
    key_refused,
)

log = logging.getLogger("streams.api")

BATCH_PATH = "/v1/sends/batch"
METRICS_PATH = "/metrics/bulk"
# Headers that describe one hop of a connection, not the request or answer (RFC 9110 7.6.1), and the
# length, which the forwarding side sets again.
HOP_HEADERS = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade",
                         b"proxy-connection", b"content-length", b"host", b"expect"})
# Set by the server that sends the answer on; forwarded, they would appear twice.
SERVER_HEADERS = frozenset({b"date", b"server"})
# How long a client's batch waits for the bulk process's answer. A bound on the wait, not on the
# publish: a broker in trouble can hold a transaction longer, and the answer then says so.
NOT_FORWARDED_BACK = HOP_HEADERS | SERVER_HEADERS
PUBLISH_WAIT_S = 180.0
PROBE_EVERY_S, PROBE_TIMEOUT_S, PROBES_MISSED_MAX = 5.0, 5.0, 3
STARTUP_POLL_S = 0.05
STARTUP_GRACE_S = 60.0  # a new bulk process is not killed for silence until it answered once or this has passed
BULK_DIR_PREFIX = "dual-rail-bulk-"
# A batch of webhook events waits at most this long for the bulk process's endpoint view to hold what
# the topics hold, so it fans out to what the API process has already shown the client.
BULK_VIEW_SYNC_S = 2.0


def die_with_parent(parent_pid: int) -> None:
    """Called by the bulk process at start: the kernel sends it SIGTERM when the API process exits.
    (Set here, not between fork and exec in the API process, which has threads by then.) If the
    API process already exited, exit now."""
    PR_SET_PDEATHSIG = 1  # noqa: N806 - the kernel's name
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:
        raise SystemExit("the ingest API process that started this bulk process has exited")


def remove_socket(socket_path: str, parent_pid: int | None = None) -> None:
    """The bulk process, on its way out: its socket, and, once the API process that made the socket's directory
    is gone (killed: it would leave it behind), that directory. While the API process lives the directory stays
    (it removes it when it stops): it is in /tmp under a name `ps` shows, and made again between two bulk
    processes, another local user could make it first and put a socket of theirs there, which the API would
    then hand every batch to, with its tenant's key."""
    path = Path(socket_path)
    path.unlink(missing_ok=True)
    if parent_pid is not None and os.getppid() == parent_pid:
        return
    if path.parent.name.startswith(BULK_DIR_PREFIX):  # that directory, never one given by hand
        try:
            path.parent.rmdir()
        except OSError:
            pass


class BulkProcess:
    """Starts the bulk process and starts it again whenever it exits, until `stop()`."""

    def __init__(self, nice: int, log_format: str | None = None, instance: str | None = None):
        self._dir = Path(tempfile.mkdtemp(prefix=BULK_DIR_PREFIX))
        self.socket_path = str(self._dir / "bulk.sock")
        # Kept across restarts: a successor takes its predecessor's transactional ids (see module doc).
        # Two API processes must never share it: DUAL_RAIL_INGEST_INSTANCE names each where hostname
        # and pid may repeat (containers sharing the host's name, each its own pid 1).
        self.instance = f"{instance or f'{socket.gethostname()}-{os.getpid()}'}-bulk"
        self.nice = nice
        self.argv = [sys.executable, "-m", "streams.cli",
                     *(["--log-format", log_format] if log_format else []),
                     "api", "--bulk-socket", self.socket_path, "--bulk-instance", self.instance,
                     "--bulk-parent", str(os.getpid())]
        self._stopping = threading.Event()
        self._process: subprocess.Popen | None = None
        self._ready = threading.Event()  # it answered once
        # Started and waited on by one thread: PR_SET_PDEATHSIG follows the thread that started the child.
        self._supervisor = threading.Thread(target=self._supervise, name="bulk-process", daemon=True)

    def start(self) -> None:
        """Start it (and keep it running); `wait_ready` then waits for its first answer."""
        self._supervisor.start()

    def wait_ready(self, timeout_s: float = 60.0) -> bool:
        """Return once it answers, so the API opens its port with batches served; if it does not
        answer in time, return False anyway: single sends are served, batches get 503 until it does
        (it is probed, killed and started again like a crashed one)."""
        if self._ready.wait(timeout_s):
            return True
        log.error("the bulk ingest process did not answer on %s within %.0f s (see its log lines above); serving "
                  "single sends, batches get 503 until it does", self.socket_path, timeout_s)
        return False

    def _answers(self, timeout_s: float = 2.0) -> bool:
        """Whether it answers an HTTP request within timeout_s. A bare socket and the status line only:
        this runs every few seconds in the API process, next to its single sends (an httpx client
        built per probe loads the CA store, ~30 ms of CPU holding the GIL, visible in their p99)."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(timeout_s)
                probe.connect(self.socket_path)
                probe.sendall(b"OPTIONS /v1/sends HTTP/1.1\r\nHost: bulk\r\nConnection: close\r\n\r\n")
                status = probe.recv(64)
        except OSError:  # missing, refused, timed out
            return False
        return status.startswith(b"HTTP/1.1 2")

    def _supervise(self) -> None:
        outage = Outage("the bulk ingest process", base_s=0.5, cap_s=30.0)
        while not self._stopping.is_set():
            Path(self.socket_path).unlink(missing_ok=True)  # the directory stays ours (`remove_socket`)
            started = time.monotonic()
            try:
                # A session of its own: a Ctrl-C meant for the API process reaches it through stop() only.
                self._process = start_in_own_session(self.argv, self.nice)
            except OSError as exc:  # no process to be had (EAGAIN at a pid limit, EMFILE, ENOMEM): asked again
                ended = f"could not be started ({exc})"
            else:
                ended = f"exited with {self._watch(self._process, started)}"
            if self._stopping.is_set():
                return
            metrics.INGEST_BULK_RESTARTS.inc()
            if time.monotonic() - started > 60:  # it ran a while: a new episode, not a crash loop
                outage.recovered(time.monotonic())
            outage.failed(time.monotonic(), ended)
            log.error("the bulk ingest process %s; starting it again in %.1f s (batches get 503 until then)", ended,
                      max(0.0, outage.next_try_at - time.monotonic()))
            self._stopping.wait(max(0.0, outage.next_try_at - time.monotonic()))

    def _watch(self, process: subprocess.Popen, started: float) -> int:
        """Wait for it to exit; kill it once it has missed PROBES_MISSED_MAX probes in a row."""
        missed, answered_once = 0, False
        while True:
            try:  # until it first answers (start-up, a few seconds) it is polled, then probed every 5 s
                return process.wait(PROBE_EVERY_S if answered_once else STARTUP_POLL_S)
            except subprocess.TimeoutExpired:
                pass
            if self._stopping.is_set():
                return process.wait()
            if self._answers(PROBE_TIMEOUT_S):
                missed, answered_once = 0, True
                self._ready.set()
            elif answered_once or time.monotonic() - started > STARTUP_GRACE_S:
                missed += 1
                if missed >= PROBES_MISSED_MAX and process.poll() is None:
                    log.error("the bulk ingest process did not answer %d probes in a row (%.0f s); killing it",
                              missed, missed * (PROBE_EVERY_S + PROBE_TIMEOUT_S))
                    process.kill()

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


def unavailable(message: str, count: bool = True, outcome: str | None = None) -> JSONResponse:
    """503; `outcome="unknown"`: the batch may have been published (the API's own answers say so alike)."""
    if count:
        metrics.INGEST_REJECTED.labels("503").inc()
    body: dict = {"error": "unavailable", "errors": [{"loc": [], "msg": message}]}
    if outcome is not None:
        body["outcome"] = outcome
    return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})


def too_many_batches(keyed: bool) -> JSONResponse:
    """429: one tenant has FORWARDS_PER_TENANT batches being published; nothing of this one was (`keyed`: an
    earlier attempt under its Idempotency-Key may have been, `"outcome": "unknown"`)."""
    metrics.INGEST_REJECTED.labels("429").inc()
    busy = f"{FORWARDS_PER_TENANT} batches of this tenant are being published: this one was not taken"
    body: dict = {"error": "too_many_batches", "errors": [{"loc": ["header", "authorization"], "msg": (
        earlier_attempt_may_be_published(busy) if keyed else
        f"{busy}, nothing was published; send it again once one is answered")}]}
    if keyed:
        body["outcome"] = "unknown"
    return JSONResponse(body, status_code=429, headers={"Retry-After": "1"})


# Batches forwarded at once, per tenant and in all. Each holds its body (up to the body limit) here and in the
# bulk process until it is answered (up to PUBLISH_WAIT_S): unbounded, one client posting batches on many
# connections to a slow broker could run the API process out of memory, and single sends (OTPs) with it.
# Counted by tenant, not by key: the bulk process publishes one batch of a tenant at a time, so a tenant's
# batches on several keys would wait there holding every place, and no other tenant's batch would be taken.
FORWARDS_PER_TENANT, FORWARDS_MAX = 4, 32


class BulkProxy:
    """ASGI: `POST /v1/sends/batch` (and `/metrics/bulk`) answered by the bulk process; the rest by `app`.
    Without a socket (no bulk process), `/metrics/bulk` is 404, so no scrape counts the API's twice."""

    def __init__(self, app, socket_path: str | None, resolve: Callable[[str], Principal | None]):
        """`resolve`: an API key's principal (None: no valid key; StoreUnavailable: Redis cannot say)."""
        self.app = app
        self.socket_path = socket_path
        self.resolve = resolve
        self.bulk = UnixHttp(socket_path, host=b"bulk") if socket_path else None
        self._forwarding: Counter[str] = Counter()  # batches being forwarded, by tenant

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.bulk is None:
            if scope["path"] == METRICS_PATH:
                return await JSONResponse({"error": "not_found", "errors": [{"loc": ["path"], "msg": (
                    "this API process has no bulk process (DUAL_RAIL_INGEST_BULK=off): its metrics are at /metrics"
                )}]}, status_code=404)(scope, receive, send)
            return await self.app(scope, receive, send)
        if scope["method"] == "POST" and scope["path"] == BATCH_PATH:
            # A keyed batch may retry an attempt whose outcome was unknown: "nothing was published" would read as
            # "not sent", and the client could send it again under a new key (twice).
            keyed = bool(first_header(scope, b"idempotency-key"))
            # Authenticated before it is forwarded: a made-up key took a place, its 5 MiB body parsed by the bulk
            # process before its 401 (a few dozen such posts kept every tenant's batches out). Never handed to the
            # API's own batch route either: it would parse and publish it in the API process, beside the OTPs.
            try:
                found = await self._principal(scope)
            except (StoreUnavailable, PublishError):  # Redis, or the state guard's operator log, cannot say
                busy = "the API key could not be checked (the state store is unavailable)"
                return await (unavailable(earlier_attempt_may_be_published(busy), outcome="unknown") if keyed
                              else unavailable(f"{busy}: nothing was published; retry after a moment"))(
                    scope, receive, send)
            if found is None or found.role != "tenant" or not found.tenant:
                return await key_refused(NOT_A_TENANT_KEY if found else NO_VALID_KEY)(scope, receive, send)
            key = found.tenant
            if self._forwarding[key] >= FORWARDS_PER_TENANT:
                return await too_many_batches(keyed)(scope, receive, send)
            if self._forwarding.total() >= FORWARDS_MAX:
                busy = f"{FORWARDS_MAX} batches are being published: this one was not taken"
                refused = (unavailable(earlier_attempt_may_be_published(busy), outcome="unknown") if keyed
                           else unavailable(f"{busy}, nothing was published; retry after a moment"))
                return await refused(scope, receive, send)
            self._forwarding[key] += 1
            try:
                return await self._forward(self.bulk, scope, receive, send, keyed)
            finally:
                self._forwarding[key] -= 1
                if not self._forwarding[key]:
                    del self._forwarding[key]
        if scope["method"] == "GET" and scope["path"] == METRICS_PATH:
            return await self._metrics(self.bulk, scope, receive, send)
        return await self.app(scope, receive, send)

    async def _principal(self, scope) -> Principal | None:
        """The principal of the batch's API key, read as the API reads it (its first Authorization header, latin-1
        as Starlette decodes headers); None for no valid key."""
        token = bearer_token(first_header(scope, b"authorization").decode("latin-1"))
        return await run_in_threadpool(self.resolve, token) if token else None

    async def _forward(self, bulk: UnixHttp, scope, receive, send, keyed: bool) -> None:
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
            answer = await bulk.request("POST", BATCH_PATH + (f"?{query}" if query else ""), headers, chunks,
                                        PUBLISH_WAIT_S)
        except Unreachable:
            if keyed:  # an earlier attempt under the key (the one that met the bulk process stopping) may have
                return await unavailable(earlier_attempt_may_be_published(
                    "the bulk ingest process is not running: it is being started again"),
                    outcome="unknown")(scope, receive, send)
            return await unavailable("the bulk ingest process is not running (it is being started again): "
                                     "nothing was published; retry after a moment")(scope, receive, send)
        except TimeoutError:
            log.warning("the bulk ingest process did not answer a batch within %.0f s", PUBLISH_WAIT_S)
            return await unavailable(f"the bulk ingest process did not answer within {PUBLISH_WAIT_S:.0f} s: it may "
                                     f"still publish this batch; {_retry(keyed)}", outcome="unknown")(scope, receive,
                                                                                                     send)
        except Interrupted as exc:
            log.warning("the bulk ingest process did not answer a batch (%s)", exc)
            return await unavailable("the bulk ingest process stopped while publishing this batch: it may or may "
                                     f"not have been published; {_retry(keyed)}", outcome="unknown")(scope, receive,
                                                                                                    send)
        await _send_back(answer, send)

    async def _metrics(self, bulk: UnixHttp, scope, receive, send) -> None:
        try:  # the app mounts its exposition at /metrics/
            answer = await bulk.request("GET", "/metrics/", [], [], PROBE_TIMEOUT_S)
        except (Unreachable, Interrupted, TimeoutError):  # a scrape, not a rejected send: not counted
            return await unavailable("the bulk ingest process is not running", count=False)(scope, receive, send)
        await _send_back(answer, send)


async def _send_back(answer: Answer, send) -> None:
    """The bulk process's answer as it came, less what the API's own server sets."""
    headers = [(k, v) for k, v in answer.headers if k not in NOT_FORWARDED_BACK]
    headers.append((b"content-length", str(len(answer.body)).encode()))
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})


def _retry(keyed: bool) -> str:
    """What a batch's client may do after an unknown outcome."""
    if keyed:
        return "retry later with the same Idempotency-Key to find out without it being sent twice"
    return "a retry without an Idempotency-Key is published under new send ids (send one to retry safely)"
