"""A set of the project's processes started together, for benchmarks and the demo.

Every process gets the same environment (one topic namespace, one mock provider) and logs to its
own file; `stop()` ends them all (SIGTERM, then SIGKILL), also on Ctrl-C.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from ..cpu_priority import start_in_own_session
from ..errors import StackError
from ..runtime import Runtime
from ..topology.admin import TopicAdmin
from ..topology.spec import channel_specs, load_definitions

# What stands for other machines (a provider, a producer's clients) runs at this nice value in the
# benchmarks that measure our share of a latency, so the CPU it takes here does not count as ours.
OUTSIDE_WORLD_NICE = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The local servers (uvicorn: the mock provider, the mock endpoint, the ingest API) close a connection idle
# for 5 s, and httpx keeps one idle for 5 s by default: a request sent on it just as the server closes it is
# lost ("Server disconnected without sending a response"). Clients that drive those servers let an idle
# connection go well before the server does.
LOCAL_KEEPALIVE_S = 1.0


def local_client(**kwargs) -> httpx.Client:
    """An httpx client for the local servers, with `kwargs` as httpx.Client takes them."""
    return httpx.Client(limits=httpx.Limits(keepalive_expiry=LOCAL_KEEPALIVE_S), **kwargs)


@dataclass
class Member:
    """One process of the fleet and how to start it again."""

    name: str
    argv: list[str]
    env: dict
    log: Path
    proc: subprocess.Popen
    restarts: int = 0
    restart_at: float | None = None  # when a dead member is started again (supervised fleets)
    nice: int = 0

    def respawn(self) -> None:
        self.proc = _spawn(self.argv, self.env, self.log, self.nice)


def _spawn(argv: list[str], env: dict, log: Path, nice: int = 0) -> subprocess.Popen:
    with open(log, "ab") as out:
        return start_in_own_session(argv, nice, env=env, stdout=out, stderr=subprocess.STDOUT)


_FORGETTABLE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*\.")


class Fleet:
    """`supervise=True` restarts a member that dies, with exponential backoff (1 s ... 30 s), and
    logs it, as a process supervisor would in a real deployment. Tests leave it off: they kill
    processes on purpose and start their replacements themselves. `forget=True` (the benchmarks)
    deletes the namespace's Redis keys and topics on exit. A benchmark leaves hundreds of thousands
    of send statuses (kept 30 days), and a Redis grown to gigabytes stalls for its AOF rewrite's fork
    (70 ms measured at 2.9 GB); it creates some 25 topics, and a broker left with thousands of
    partitions by earlier runs spends its heap on them (young-generation pauses of 50-150 ms
    measured at 7,400). Either would show up in the next benchmark's tail."""

    def __init__(self, namespace: str, log_dir: Path, base_env: dict | None = None, supervise: bool = False,
                 forget: bool = False):
        if forget and (not _FORGETTABLE.fullmatch(namespace) or namespace == "notif."):
            # Forgetting deletes every topic and key whose name starts with the namespace: "bench1"
            # would take "bench10." with it, "" or "notif." the stack's own, and "*" is a key pattern.
            raise ValueError(f"a fleet that forgets its topics and keys needs a namespace of letters, digits, '_' or "
                             f"'-' ending with a dot, not the stack's own 'notif.' (got {namespace!r})")
        self.namespace = namespace
        self.forget = forget
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        # The children inherit this process's environment (copied, not parsed: each child parses
        # its own settings with streams.config).
        self.env = {"LOG_LEVEL": "WARNING", **(base_env or os.environ), "DUAL_RAIL_TOPIC_NAMESPACE": namespace}
        self.members: list[Member] = []
        self.mock_url = ""
        # The nice value of what stands for the outside world on this machine (the mock provider, a
        # benchmark's blaster): 0 by default; a benchmark that measures our share of a latency sets
        # it, so that stand-ins for remote machines do not take the CPU our roles would have.
        self.outside_world_nice = 0
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        if supervise:
            self._supervisor = threading.Thread(target=self._supervise, name="fleet-supervisor", daemon=True)
            self._supervisor.start()

    @property
    def procs(self) -> list[tuple[str, subprocess.Popen, Path]]:
        return [(m.name, m.proc, m.log) for m in self.members]

    def _supervise(self) -> None:
        while not self._stopping.wait(0.5):
            for m in list(self.members):
                code = m.proc.poll()
                if code is None or self._stopping.is_set():
                    continue
                now = time.monotonic()
                if m.restart_at is None:
                    m.restart_at = now + min(30.0, 2.0 ** m.restarts)
                    print(f"fleet: {m.name} exited ({code}); restarting in {m.restart_at - now:.0f} s "
                          f"(log: {m.log})", file=sys.stderr, flush=True)
                elif now >= m.restart_at:
                    m.restarts += 1
                    m.restart_at = None
                    m.respawn()
                    print(f"fleet: restarted {m.name} (restart #{m.restarts})", file=sys.stderr, flush=True)

    @property
    def runtime(self) -> Runtime:
        """Built from the current environment (start_mock adds the provider settings)."""
        return Runtime.from_env(self.env)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        if self.forget:
            self._forget()

    def _forget(self) -> None:
        """Best effort: a stack that went away must not hide the run's result (or its own error)."""
        for what, delete in (("Redis keys", self.delete_keys), ("topics", self.delete_topics)):
            try:
                delete()
            except Exception as exc:  # noqa: BLE001 - reported, and the stack can be wiped by hand
                print(f"fleet: could not delete the {what} of namespace {self.namespace!r} ({type(exc).__name__}: "
                      f"{exc}); delete those whose names start with {self.namespace!r} (on a local stack, "
                      f"`streams dev down --wipe` clears every namespace)", file=sys.stderr, flush=True)

    def delete_keys(self) -> int:
        """Delete every Redis key of this fleet's namespace; returns how many."""
        client = self.runtime.redis()
        deleted, batch = 0, []
        for key in client.scan_iter(match=f"{self.namespace}*", count=10_000):
            batch.append(key)
            if len(batch) == 1000:
                deleted += self._unlink(client, batch)
                batch = []
        return deleted + self._unlink(client, batch)

    def delete_topics(self) -> int:
        """Delete every topic of this fleet's namespace; returns how many."""
        admin = TopicAdmin(self.runtime.bootstrap)
        names = admin.named(self.namespace)
        admin.delete(names)
        return len(names)

    @staticmethod
    def _unlink(client, keys: list) -> int:
        pipe = client.pipeline(transaction=False)
        for key in keys:  # one key per command: keys of a Redis Cluster live in different slots
            pipe.unlink(key)
        pipe.execute()
        return len(keys)

    def create_topics(self, channels: tuple[str, ...] = ("email",)) -> None:
        TopicAdmin(self.runtime.bootstrap).ensure(
            channel_specs(load_definitions(namespace=self.namespace, profile=self.runtime.config.topic_profile),
                          self.namespace, channels))

    def start(self, name: str, *args: str, ready: str | None = None, env: dict | None = None,
              module: str = "streams.cli", nice: int = 0) -> subprocess.Popen:
        """Start `python -m <module> <args>` (at a lower CPU priority with `nice`); with `ready`,
        wait until its log shows that line."""
        log = self.log_dir / f"{len(self.members):02d}-{name}.log"
        log.write_bytes(b"")
        argv, full_env = [sys.executable, "-m", module, *args], {**self.env, **(env or {})}
        proc = _spawn(argv, full_env, log, nice)
        self.members.append(Member(name, argv, full_env, log, proc, nice=nice))
        if ready:
            deadline = time.monotonic() + 60
            while ready not in log.read_text(errors="replace"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise StackError(f"{name} did not start:\n{log.read_text(errors='replace')[-2000:]}")
                time.sleep(0.05)
        return proc

    def start_mock(self, rate: float, latency_ms: float) -> str:
        port = free_port()
        self.start("mock-provider", "mock-provider", "--port", str(port), "--rate", str(rate),
                   "--latency-ms", str(latency_ms), ready="mock provider on", nice=self.outside_world_nice)
        self.mock_url = f"http://127.0.0.1:{port}"
        client = local_client(base_url=self.mock_url, timeout=10)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.get("/_mock/stats").raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise StackError("the mock provider did not answer") from None
                time.sleep(0.05)
        keys = '{"*": "re_bench_default"}'
        self.env.update({"RESEND_BASE_URL": self.mock_url, "SMS_BASE_URL": self.mock_url,
                         "RESEND_API_KEYS": keys, "SMS_API_KEYS": keys})
        return self.mock_url

    def stop(self) -> None:
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(5)
        for m in self.members:
            if m.proc.poll() is None:
                m.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20  # one for all: waited in turn, a few stuck roles took a minute each
        for m in self.members:
            try:
                m.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                m.proc.kill()
                m.proc.wait()
        self.members = []

    def worker(self, channel: str, lane: str, *extra: str, env: dict | None = None) -> subprocess.Popen:
        return self.start(f"worker-{channel}-{lane}", "worker", "--channel", channel, "--lane", lane, *extra,
                          env=env, ready="consuming")

    def retrier(self, channel: str, lane: str, env: dict | None = None) -> subprocess.Popen:
        """One retrier serves every tier of a lane."""
        return self.start(f"retrier-{channel}-{lane}", "retrier", "--channel", channel, "--lane", lane,
                          env=env, ready="retrier consuming")

    def logs(self, tail: int = 2000) -> str:
        """The end of every process's log, for a failure report."""
        return "\n".join(f"--- {log.name} (exit {p.poll()})\n{log.read_text(errors='replace')[-tail:]}"
                         for _, p, log in self.procs)


def start_dispatch(fleet: Fleet, provider_rps: int, latency_ms: float, baseline: bool = False,
                   with_api: bool = True, marketing_metrics_port: int = 0, stage_log: Path | None = None) -> dict:
    """The whole dispatch stack for one channel (email): mock provider, limits, ingest API and
    outcome recorder (`with_api`), lag monitor, workers and retriers. `baseline` runs the naive
    design instead: one shared FIFO lane, no yielding. With `stage_log`, the transactional worker
    (only: a blast's worker does not pay for a line per send) writes its stage timings there.
    Returns the addresses (and API keys) a load generator needs."""
    fleet.create_topics()
    fleet.start_mock(provider_rps, latency_ms)
    rt = fleet.runtime
    r = rt.redis()
    limits = rt.limit_store(r)
    # The gate mirrors the provider's limit; a burst of half a second absorbs request-arrival jitter
    # at the provider; the reserve keeps the last tokens for transactional sends.
    limits.set_provider("resend", provider_rps, max(2, provider_rps // 2),
                        reserve=0 if baseline else max(1, provider_rps // 10))
    limits.set_tenant("resend", "*", 1_000_000, 100)
    info = {"MOCK_URL": fleet.mock_url}
    if with_api:
        keys = rt.api_keys(r)
        info.update(BLAST_KEY=keys.create("tenant", "blaster"), OTP_KEY=keys.create("tenant", "shop"))
        api_port = free_port()
        if baseline:
            fleet.start("api-baseline", "api", "--port", str(api_port), module="streams.devtools.baseline")
        else:
            fleet.start("api", "api", "--port", str(api_port))
        fleet.start("outcome-recorder", "outcome-recorder")
    if baseline:
        fleet.start("worker-baseline", "worker", "--channel", "email", ready="consuming",
                    module="streams.devtools.baseline")
    else:
        fleet.start("lag-monitor", "lag-monitor", "--interval", "0.25", ready="lag monitor publishing")
        fleet.worker("email", "transactional", env={"DUAL_RAIL_STAGE_LOG": str(stage_log)} if stage_log else None)
        fleet.worker("email", "marketing", "--metrics-port", str(marketing_metrics_port))
        for lane in ("transactional", "marketing"):
            fleet.retrier("email", lane)
    if not with_api:
        return info
    api = f"http://127.0.0.1:{api_port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{api}/openapi.json", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise StackError("the ingest API did not answer")
        time.sleep(0.1)
    info["API_URL"] = api
    return info
