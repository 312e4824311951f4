"""`streams bench throughput`: messages/s through one marketing worker against an unlimited mock
provider, side by side in one run with (a) a bare confluent-kafka consume-and-decode loop (the
ceiling) and (b) a naive worker doing one gate call and one HTTP request per message.

Each rate is steady state: measured from the first message consumed to the last one done, so the
consumer-group join, which all three pay once, is not counted."""

from __future__ import annotations

import os
import resource
import threading
import time
import uuid
from pathlib import Path

from confluent_kafka import Consumer

from ..dispatch.idempotency import idempotency_key
from ..gate.gate import RedisGate
from ..gate.limits import LimitStore
from ..kafka_client import client_config
from ..providers.outcome import Outbound
from ..providers.resend import ResendEmail
from ..send import decode
from .bench_blast import _email
from .fleet import Fleet, local_client

TENANT = "bulk"


def machine_busy_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, every core counted (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / tick, sum(fields) / tick


def child_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a child process has used so far (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class FirstMessageClock:
    """A consumer that notes when its first message arrived (everything else passes through)."""

    def __init__(self, consumer: Consumer):
        self._consumer = consumer
        self.first_at: float | None = None
        self.cpu_at_first = 0.0                # this process's CPU seconds then
        self.machine_at_first = (0.0, 0.0)     # the machine's (busy, total) CPU seconds then

    def _first(self) -> None:
        self.first_at = time.perf_counter()
        self.cpu_at_first, self.machine_at_first = process_cpu_s(), machine_busy_s()

    def poll(self, *args, **kwargs):
        msg = self._consumer.poll(*args, **kwargs)
        if msg is not None and self.first_at is None:
            self._first()
        return msg

    def consume(self, *args, **kwargs):
        msgs = self._consumer.consume(*args, **kwargs)
        if msgs and self.first_at is None:
            self._first()
        return msgs

    def __getattr__(self, name: str):
        return getattr(self._consumer, name)


def _consume(bootstrap: str, topic: str, n: int, handle) -> float:
    """Consume n messages of `topic` through a fresh group, calling handle(msg); returns the seconds
    from the first message to the last (steady state: the group join is not counted)."""
    c = Consumer(client_config(bootstrap, settings={"group.id": f"bench-{uuid.uuid4().hex}",
                                             "auto.offset.reset": "earliest", "enable.auto.commit": False}))
    c.subscribe([topic])
    seen = 0
    started: float | None = None
    try:
        while seen < n:
            for msg in c.consume(num_messages=1000, timeout=0.5):
                if msg.error():
                    continue
                started = started or time.perf_counter()
                handle(msg)
                seen += 1
                if seen >= n:
                    break
    finally:
        c.close()
    return time.perf_counter() - (started or time.perf_counter())


def run(n: int = 20_000, naive_n: int = 2_000, log_dir: Path | None = None, progress=lambda m: None,
        profile: bool = False, concurrency: int = 8, tenant_burst: int = 100) -> dict:
    stamp = int(time.time())
    with Fleet(f"tput{stamp}.", log_dir or Path(f"/tmp/dual-rail-tput-{stamp}"), forget=True) as fleet:
        fleet.create_topics()
        url = fleet.start_mock(rate=1_000_000, latency_ms=0)
        mock_pid = fleet.members[-1].proc.pid
        rt = fleet.runtime
        redis_client = rt.redis()
        limits = LimitStore(redis_client, fleet.namespace)
        limits.set_provider("resend", 1_000_000, 1_000_000)
        limits.set_tenant("resend", "*", 1_000_000, tenant_burst)
        topic = rt.names.lane("email", "marketing")
        client = rt.send_client()
        progress(f"publishing {n} marketing emails")
        for start in range(0, n, 1000):
            client.publish_batch(TENANT, [_email("marketing")] * min(1000, n - start))
        mock = local_client(base_url=url, timeout=30)

        progress("ceiling: consume and decode")
        ceiling_s = _consume(rt.bootstrap, topic, n, lambda m: decode(m.value()))

        progress("naive: one gate call and one HTTP request per message")
        gate = RedisGate(redis_client, fleet.namespace)
        provider = ResendEmail(rt.config.registry.primary("email"), url)

        def naive(msg) -> None:
            send = decode(msg.value())
            while not gate.acquire("resend", send.tenant_id, 1).allowed:
                pass
            path, body = provider.build([Outbound(send.send_id, send.tenant_id, "naive", send.payload)], batch=False)
            provider.post(path, body, "re_bench_default", idempotency_key([send.send_id]))

        naive_s = _consume(rt.bootstrap, topic, naive_n, naive)
        provider.close()
        mock.post("/_mock/reset").raise_for_status()

        progress("worker: the lane worker, in this process")
        mock_cpu_before = child_cpu_s(mock_pid)
        worker = rt.worker("email", "marketing", concurrency=concurrency)
        all_delivered = threading.Event()

        def watch_mock() -> None:  # off the worker's thread: asking the mock costs the worker nothing
            with local_client(base_url=url, timeout=30) as watcher:
                while watcher.get("/_mock/stats").json()["messages_delivered"] < n:
                    time.sleep(0.05)  # polling interval of an outside observer
            all_delivered.set()

        threading.Thread(target=watch_mock, daemon=True).start()
        finished = all_delivered.is_set

        timed = FirstMessageClock(worker.consumer)
        worker.consumer = timed  # the clock starts at the first message, as for the others
        profile_top: list[str] = []
        if profile:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            profiler.runcall(worker.run, until=finished)
            top = pstats.Stats(profiler).sort_stats("tottime")
            profile_top = [f"{fn[2]} ({Path(fn[0]).name}:{fn[1]}): {st[2]:.2f} s own, {st[3]:.2f} s total"
                           for fn, st in sorted(top.stats.items(), key=lambda kv: -kv[1][2])[:15]]  # type: ignore[attr-defined]
        else:
            worker.run(until=finished)
        worker_s = time.perf_counter() - (timed.first_at or time.perf_counter())
        worker_cpu_s = process_cpu_s() - timed.cpu_at_first  # steady state, as the rate
        busy_after, total_after = machine_busy_s()
        busy_before, total_before = timed.machine_at_first
        mock_cpu_s = child_cpu_s(mock_pid) - mock_cpu_before
        stats = mock.get("/_mock/stats").json()

    worker_rate, naive_rate, ceiling_rate = n / worker_s, naive_n / naive_s, n / ceiling_s
    machine_cpu_s = busy_after - busy_before
    return {
        "messages": n, "naive_messages": naive_n, "worker_concurrency": concurrency, "tenant_burst": tenant_burst,
        "worker_msgs_per_s": round(worker_rate, 1),
        "naive_msgs_per_s": round(naive_rate, 1),
        "consume_ceiling_msgs_per_s": round(ceiling_rate, 1),
        "ratio_vs_naive": round(worker_rate / naive_rate, 2),
        "ratio_vs_ceiling": round(worker_rate / ceiling_rate, 3),
        # What limits the rate: the worker process's own CPU per message (every thread), and how busy
        # the machine's cores were meanwhile (the broker, Redis and the mock provider share them).
        "worker_cpu_us_per_msg": round(worker_cpu_s / n * 1e6, 1),
        "machine_cpu_busy": round((busy_after - busy_before) / max(1e-9, total_after - total_before), 2),
        "cpu_cores": os.cpu_count(),
        "mock_provider_cpu_ms_per_request": round(mock_cpu_s / max(1, stats["requests_total"]) * 1000, 2),
        # Every process on the machine shares its cores: the machine's CPU per message, and what the
        # broker, Redis and the OS took of it (neither this process nor the mock provider), bound
        # the rate any worker could reach here: cores / machine CPU per message.
        "machine_cpu_us_per_msg": round(machine_cpu_s / n * 1e6, 1),
        "others_cpu_us_per_msg": round((machine_cpu_s - worker_cpu_s - mock_cpu_s) / n * 1e6, 1),
        "machine_bound_msgs_per_s": round((os.cpu_count() or 1) * n / max(1e-9, machine_cpu_s), 1),
        "worker_provider_requests": stats["requests_total"],
        "worker_duplicates": stats["duplicate_deliveries"],
        **({"profile_top_own_time": profile_top} if profile else {}),
    }
