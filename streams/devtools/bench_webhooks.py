"""`streams bench webhooks`: one webhook worker process delivering to 200 endpoints whose receivers take
200 ms, 10% of which time out (10 s each), side by side in one run with (a) the same load where no
endpoint fails and (b) a naive loop that sends one request at a time. Latency is measured under a
steady load the worker keeps up with (500 deliveries/s for 10 s: each healthy delivery's time from
publication to its receiver); throughput from a burst published all at once (how fast the healthy
deliveries are drained).

It shows the two things the webhook design promises: throughput (hundreds of deliveries in flight)
and isolation (a failing endpoint does not slow the healthy ones: their p99 stays within 1.5x of a
run without failures). Everything is real: the local Kafka and Redis, the project's worker as a
separate process, the mock receiver as an HTTP server.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import httpx

from ..send import validate_request
from ..webhooks.delivery import delivery_body
from ..webhooks.fanout import fan_out
from ..webhooks.model import Endpoint
from ..webhooks.signing import headers as signed_headers
from .fleet import Fleet, free_port, local_client

ENDPOINTS = 200
TENANTS = 4  # 50 endpoints each: a tenant may have at most 50


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _event(i: int) -> dict:
    return {"channel": "webhook", "category": "transactional",
            "payload": {"event_type": "bench.tick", "occurredAt": "2026-11-30T12:00:00Z", "data": {"n": i}}}


class Receiver:
    def __init__(self, fleet: Fleet, latency_ms: float):
        port = free_port()
        fleet.start("mock-endpoint", "mock-endpoint", "--port", str(port), ready="mock endpoint on")
        self.base = f"http://127.0.0.1:{port}"
        self.http = local_client(base_url=self.base, timeout=30)
        deadline = time.monotonic() + 20
        while True:  # the banner comes before the server listens
            try:
                self.http.post("/_mock/defaults", json={"latency_ms": latency_ms}).raise_for_status()
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stats(self, deliveries: bool = False) -> dict:
        return self.http.get("/_mock/stats", params={"deliveries": "1"} if deliveries else None).json()


def _publish(client, endpoints: list[Endpoint], n: int, offset: int, published: dict, rate: float | None) -> None:
    """n deliveries round-robin over the endpoints; `rate` paces them (None: all at once)."""
    started = time.monotonic()
    batch = []
    for i in range(n):
        endpoint = endpoints[i % ENDPOINTS]
        _, [delivery] = fan_out(validate_request(_event(offset + i)), endpoint.tenant, [endpoint], client.routing)
        batch.append(delivery)
        published[delivery.send_id] = (delivery.created_at_ms, delivery.payload["endpoint_id"])
        if len(batch) == (50 if rate else 1000):
            client.publish_sends(batch)
            batch = []
            if rate:  # pacing a load generator, not synchronizing anything
                time.sleep(max(0.0, started + (i + 1) / rate - time.monotonic()))
    if batch:
        client.publish_sends(batch)


def _drain(receiver: Receiver, wanted: set[str], label: str, progress) -> dict:
    deadline = time.monotonic() + 300
    stats: dict = {}
    while time.monotonic() < deadline:
        try:
            stats = receiver.stats(deliveries=True)
        except httpx.HTTPError:
            time.sleep(1.0)  # the receiver is busy; ask again
            continue
        got = len(wanted & set(stats["deliveries"]))
        progress(f"{label}: {got}/{len(wanted)} delivered")
        if got >= len(wanted):
            break
        time.sleep(1.0)  # polling an external counter while the fleet works
    return stats


def _run_once(stamp: int, label: str, log_dir: Path, burst: int, failing: int, latency_ms: float, rate: float,
              paced_s: float, progress) -> dict:
    env = {"WEBHOOK_REQUIRE_HTTPS": "0", "WEBHOOK_ALLOW_HOSTS": "127.0.0.1", "LOG_LEVEL": "ERROR"}
    with Fleet(f"hooks{stamp}{label}.", log_dir / label, base_env={**os.environ, **env}, supervise=True,
               forget=True) as fleet:
        fleet.create_topics(("webhook",))
        receiver = Receiver(fleet, latency_ms)
        rt = fleet.runtime
        r = rt.redis()
        limits = rt.limit_store(r)
        limits.set_provider("webhook", 1_000_000, 1_000_000)
        limits.set_tenant("webhook", "*", 1_000_000, 100_000)
        store = rt.endpoint_store(r)
        endpoints: list[Endpoint] = []
        for i in range(ENDPOINTS):
            ep, _ = store.create(f"hooks{i % TENANTS}", f"{receiver.base}/hooks/e{i}", ["bench.tick"])
            endpoints.append(ep)
            if i < failing:
                receiver.http.post(f"/_mock/endpoints/e{i}", json={"timeout": True}).raise_for_status()
        failing_ids = {ep.id for ep in endpoints[:failing]}
        fleet.start("webhook-worker", "worker", "--channel", "webhook", "--lane", "transactional", ready="consuming")
        fleet.retrier("webhook", "transactional")
        client = rt.send_client()

        def healthy(published: dict) -> set[str]:
            return {d for d, (_, ep) in published.items() if ep not in failing_ids}

        # Latency: a steady load the worker keeps up with; each healthy delivery's time to its receiver.
        progress(f"{label}: {rate:g} deliveries/s for {paced_s:g} s to {ENDPOINTS} endpoints ({failing} time out)")
        paced: dict[str, tuple[int, str]] = {}
        _publish(client, endpoints, int(rate * paced_s), 0, paced, rate)
        stats = _drain(receiver, healthy(paced), f"{label} paced", progress)
        firsts = {d: min(stats["deliveries"][d]) for d in healthy(paced) if d in stats["deliveries"]}
        latencies = [firsts[d] * 1000 - paced[d][0] for d in firsts]
        # Throughput: a burst all at once, and how fast the worker drains it.
        progress(f"{label}: a burst of {burst}")
        bursted: dict[str, tuple[int, str]] = {}
        _publish(client, endpoints, burst, len(paced), bursted, None)
        stats = _drain(receiver, healthy(bursted), f"{label} burst", progress)
        received = stats["deliveries"]
        times = [min(received[d]) for d in healthy(bursted) if d in received]
        span = max(times) - min(times) if times else float("nan")
        wanted = healthy(paced) | healthy(bursted)
        return {"deliveries_per_s": round(len(times) / span, 1) if span else float("nan"),
                "p50_ms": round(_percentile(latencies, 0.5), 1), "p99_ms": round(_percentile(latencies, 0.99), 1),
                "lost": len(wanted - set(received)), "duplicates": stats["duplicates"]}


def _naive(stamp: int, log_dir: Path, n: int, latency_ms: float) -> float:
    """One request at a time, signed, to healthy endpoints: what a simple loop reaches."""
    with Fleet(f"hooks{stamp}naive.", log_dir / "naive", forget=True) as fleet:
        receiver = Receiver(fleet, latency_ms)
        body = delivery_body({"event_id": "e", "event_type": "bench.tick", "occurredAt": "2026-11-30T12:00:00Z",
                              "data": {"n": 1}})
        secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
        with local_client(timeout=10) as http:
            started = time.perf_counter()
            for i in range(n):
                h = signed_headers([secret], f"naive-{i}", int(time.time()), body)
                http.post(f"{receiver.base}/hooks/e{i % ENDPOINTS}", content=body, headers=h)
            return n / (time.perf_counter() - started)


def run(deliveries: int = 10_000, naive_n: int = 100, latency_ms: float = 200.0, rate: float = 500.0,
        paced_s: float = 10.0, log_dir: Path | None = None, progress=lambda m: None) -> dict:
    stamp = int(time.time())
    log_dir = log_dir or Path(f"/tmp/dual-rail-hooks-{stamp}")
    failing = ENDPOINTS // 10
    with_failures = _run_once(stamp, "failing", log_dir, deliveries, failing, latency_ms, rate, paced_s, progress)
    no_failures = _run_once(stamp, "healthy", log_dir, deliveries, 0, latency_ms, rate, paced_s, progress)
    progress(f"naive: {naive_n} requests one at a time")
    naive = _naive(stamp, log_dir, naive_n, latency_ms)
    return {
        "endpoints": ENDPOINTS, "failing_endpoints": failing, "receiver_latency_ms": latency_ms,
        "burst": deliveries, "paced_rate_per_s": rate, "paced_seconds": paced_s,
        "deliveries_per_s": with_failures["deliveries_per_s"],
        "deliveries_per_s_no_failures": no_failures["deliveries_per_s"],
        "naive_deliveries_per_s": round(naive, 1),
        "healthy_p50_ms": with_failures["p50_ms"], "healthy_p99_ms": with_failures["p99_ms"],
        "healthy_p99_ms_no_failures": no_failures["p99_ms"],
        "p99_ratio_failing_vs_none": round(with_failures["p99_ms"] / no_failures["p99_ms"], 2),
        "lost": with_failures["lost"] + no_failures["lost"],
        "duplicates": with_failures["duplicates"] + no_failures["duplicates"],
    }
