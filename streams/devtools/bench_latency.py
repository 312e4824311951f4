"""`streams bench latency`: where an OTP's milliseconds go, idle and under a marketing blast.

One OTP at a time at a steady rate is published with the SDK (timed: ingest -> broker ack), and
the transactional lane worker (only it: the blast's worker runs as in production) writes each
delivered send's stage timings from its own clock (DUAL_RAIL_STAGE_LOG; `streams/dispatch/stages.py`).
Stages per OTP:

    ingest_to_ack      publish call -> the broker acknowledged it (the SDK's own measurement)
    ack_to_poll        broker ack -> the worker's consumer returned it
    queueing           returned -> taken from its tenant queue for a request
    gate               taken -> processed_jobs read and both buckets passed
    claim              admitted -> claimed with its request body
    provider           handed to the adapter -> the answer collected (includes the provider's latency)
    outcome_ack        answer -> the outcome event acknowledged by the broker
    offset_store       acknowledged -> the delivered mark written (its offset stored in that step)

End to end is creation -> the provider's answer collected; our share (`overhead`) is end to end
minus the provider stage (the request as our HTTP client timed it: the provider's latency, which
under a blast includes the provider queueing our OTP behind the blast's requests). The same clock
(this machine's) is read by every process.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
import uuid
from pathlib import Path

import orjson

from ..config import StackConfig
from .bench_blast import _email
from .fleet import OUTSIDE_WORLD_NICE, Fleet, start_dispatch

STAGES = {"ack_to_poll": ("ack", "consumed"), "queueing": ("consumed", "dequeued"), "gate": ("dequeued", "admitted"),
          "claim": ("admitted", "claimed"), "provider": ("sent", "answered"), "outcome_ack": ("answered", "acked"),
          "offset_store": ("acked", "marked")}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] if ordered else float("nan")


def _summary(values: list[float]) -> dict:
    return {"p50": round(_pct(values, 0.5), 2), "p99": round(_pct(values, 0.99), 2), "n": len(values)}


def _otps(client, n: int, rate: float, sent: dict[str, tuple[float, float]]) -> None:
    """n OTPs at `rate` per second, one per publish call; records (start, acknowledged) in wall ms."""
    started = time.monotonic()
    for i in range(n):
        t0 = time.time() * 1000
        [send_id] = client.publish_batch("shop", [_email("transactional")])
        sent[send_id] = (t0, time.time() * 1000)
        time.sleep(max(0.0, started + (i + 1) / rate - time.monotonic()))  # pacing a load generator


def _wait_logged(path: Path, ids: set[str], timeout_s: float) -> dict[str, dict]:
    deadline = time.monotonic() + timeout_s
    seen: dict[str, dict] = {}
    while time.monotonic() < deadline:
        if path.exists():
            for line in path.read_bytes().splitlines():
                doc = orjson.loads(line)
                seen[doc["send_id"]] = doc
        if ids <= set(seen):
            break
        time.sleep(0.5)  # polling a file the worker appends to
    return {i: seen[i] for i in ids if i in seen}


def _phase(sent: dict[str, tuple[float, float]], logged: dict[str, dict], latency_ms: float) -> dict:
    stages: dict[str, list[float]] = {"ingest_to_ack": [], **{k: [] for k in STAGES}}
    e2e, overhead = [], []
    partial = 0
    for send_id, (t0, ack) in sent.items():
        doc = logged.get(send_id)
        if not doc:
            continue
        if not all(k in doc for k in ("consumed", "dequeued", "admitted", "claimed", "sent", "answered", "acked")):
            partial += 1  # settled by a recovered request: not every stage was stamped
            continue
        stamps = {**doc, "ack": ack}
        stages["ingest_to_ack"].append(ack - t0)
        for name, (a, b) in STAGES.items():
            stages[name].append(stamps[b] - stamps[a])
        e2e.append(doc["answered"] - t0)
        overhead.append(doc["answered"] - t0 - (doc["answered"] - doc["sent"]))
    return {"samples": len(e2e), "without_every_stage": partial, "end_to_end_ms": _summary(e2e),
            "overhead_ms": _summary(overhead),
            "stages_ms": {k: _summary(v) for k, v in stages.items()},
            "dominant_stage_p99": max(stages, key=lambda k: _pct(stages[k], 0.99)) if e2e else None}




def run(n: int = 1000, rate: float = 40.0, provider_rps: int = 100, latency_ms: float = 50.0,
        progress=print) -> dict:
    stamp = uuid.uuid4().hex[:6]
    home = StackConfig.from_env().home
    stage_log = Path(tempfile.mkdtemp(prefix="stages-")) / "stages.jsonl"
    env = {**os.environ, "LOG_LEVEL": "ERROR"}
    with Fleet(f"lat{stamp}.", home / "bench" / f"latency-{stamp}", base_env=env, forget=True) as fleet:
        progress(f"starting: mock provider ({provider_rps} req/s, {latency_ms:g} ms), both lanes, lag monitor")
        fleet.outside_world_nice = OUTSIDE_WORLD_NICE
        start_dispatch(fleet, provider_rps, latency_ms, with_api=False, stage_log=stage_log)
        client = fleet.runtime.send_client()
        _otps(client, 20, rate, {})  # warm up the producer, the workers' connections, the provider's pool
        progress(f"idle: {n} OTPs at {rate:g}/s")
        idle: dict[str, tuple[float, float]] = {}
        _otps(client, n, rate, idle)
        idle_logged = _wait_logged(stage_log, set(idle), 60)
        blast_n = int(provider_rps * 100 * (n / rate + 10))  # enough to keep the provider busy all phase long
        progress(f"under a blast of {blast_n} marketing emails: {n} OTPs at {rate:g}/s")
        # The blast comes from a producer process of its own, as it would in production.
        fleet.start("blaster", "--count", str(blast_n), module="streams.devtools.blaster",
                    ready="blaster publishing", nice=fleet.outside_world_nice)
        time.sleep(2.0)  # the blast is under way before the measured OTPs start (pacing, not syncing)
        loaded: dict[str, tuple[float, float]] = {}
        _otps(client, n, rate, loaded)
        loaded_logged = _wait_logged(stage_log, set(loaded), 120)
    idle_r, blast_r = _phase(idle, idle_logged, latency_ms), _phase(loaded, loaded_logged, latency_ms)
    return {
        "benchmark": "otp-latency", "otps_per_phase": n, "otp_rate_per_s": rate,
        "provider_rps": provider_rps, "provider_latency_ms": latency_ms,
        "outside_world_nice": OUTSIDE_WORLD_NICE, "marketing_nice": fleet.runtime.config.marketing_nice,
        "overhead_p50_ms_idle": idle_r["overhead_ms"]["p50"], "overhead_p99_ms_idle": idle_r["overhead_ms"]["p99"],
        "overhead_p50_ms_blast": blast_r["overhead_ms"]["p50"], "overhead_p99_ms_blast": blast_r["overhead_ms"]["p99"],
        "blast_to_idle_p99": round(blast_r["overhead_ms"]["p99"] / idle_r["overhead_ms"]["p99"], 2)
        if idle_r["overhead_ms"]["p99"] else None,
        "stages": {"idle": idle_r["stages_ms"], "blast": blast_r["stages_ms"]},
        "idle": idle_r, "blast": blast_r,
    }
