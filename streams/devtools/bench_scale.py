"""`streams bench scale`: msgs/s through 1, 2 and 4 marketing worker processes of one consumer group
against an unlimited mock provider, and each rate's ratio to one worker's. Every run publishes the
same number of messages (from 8 tenants, so every partition carries work) to a fresh namespace,
then starts the workers on the full topic; the clock runs from the first delivery at the mock to
the last, so the group's join is not counted (as in `bench throughput`).

On this machine (2 cores) the workers share the cores with the broker, Redis and the mock provider:
the figure says how much of a second core a second worker can use, not how far the design scales.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from ..config import StackConfig
from .bench_blast import _email
from .fleet import Fleet, local_client


def _one(workers: int, n: int, home: Path, progress) -> dict:
    stamp = uuid.uuid4().hex[:6]
    env = {**os.environ, "LOG_LEVEL": "ERROR"}
    with Fleet(f"scale{stamp}.", home / "bench" / f"scale-{stamp}-{workers}", base_env=env, forget=True) as fleet:
        fleet.create_topics()
        url = fleet.start_mock(1_000_000, 0.0)
        rt = fleet.runtime
        limits = rt.limit_store()
        limits.set_provider("resend", 1_000_000, 1_000_000)
        limits.set_tenant("resend", "*", 1_000_000, 100)
        client = rt.send_client()
        tenants = [f"bulk{i}" for i in range(8)]  # several tenants: partitions carry work for every worker
        for start in range(0, n, 1000):
            client.publish_batch(tenants[(start // 1000) % len(tenants)], [_email("marketing")] * min(1000, n - start))
        mock = local_client(base_url=url, timeout=30)
        progress(f"{workers} worker(s): {n} messages waiting")
        for i in range(workers):
            fleet.start(f"worker-{i}", "worker", "--channel", "email", "--lane", "marketing", ready="consuming")
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            stats = mock.get("/_mock/stats", params={"deliveries": "1"}).json()
            if stats["messages_delivered"] >= n:
                break
            time.sleep(0.5)  # polling an external counter while the workers work
        times = sorted(t for ts in stats["deliveries"].values() for t in ts)
        span = times[-1] - times[0] if len(times) > 1 else float("nan")
        return {"workers": workers, "messages": stats["messages_delivered"], "seconds": round(span, 2),
                "msgs_per_s": round(n / span, 1) if span else None, "duplicates": stats["duplicate_deliveries"]}


def run(n: int = 40_000, counts: tuple[int, ...] = (1, 2, 4), progress=print) -> dict:
    home = StackConfig.from_env().home
    runs = [_one(k, n, home, progress) for k in counts]
    one = runs[0]["msgs_per_s"] or 1.0
    for r in runs:
        r["ratio_to_one_worker"] = round((r["msgs_per_s"] or 0) / one, 2)
    return {"benchmark": "scale", "messages": n, "cores": os.cpu_count(), "runs": runs,
            "note": "workers share the machine's cores with the broker, Redis and the mock provider"}
