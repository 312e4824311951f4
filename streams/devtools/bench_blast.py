"""`streams bench blast-vs-otp`: tenant A blasts marketing email as fast as the provider allows while
tenant B sends OTPs at a constant rate; OTP end-to-end latency (accepted -> received by the
provider) is compared idle, under the blast, and under the same blast through one shared FIFO lane
with no yielding (the naive design), side by side in one run.

Everything is real: the local Kafka and Redis, the mock provider as an HTTP server with a team
limit, and the project's workers, retriers and lag monitor as separate processes.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ..ingest.sdk import SendClient
from ..retry.dlq import read_all
from .baseline import single_lane
from .fleet import Fleet, free_port, local_client, start_dispatch

OTP_TENANT, BLAST_TENANT = "shop", "blaster"
WARM_UP_S = 2.0
MIN_OTPS = 500  # per phase


def _email(category: str) -> dict:
    return {"channel": "email", "category": category, "template_id": "bench", "template_version": "1",
            "payload": {"from": "Bench <bench@acme.test>", "to": ["someone@example.test"],
                        "subject": "Your code" if category == "transactional" else "Our sale",
                        "html": "<p>" + "x" * 200 + "</p>"}}


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass
class Published:
    created_ms: dict[str, int] = field(default_factory=dict)

    def add(self, client: SendClient, tenant: str, requests: list[dict]) -> list[str]:
        ids = client.publish_batch(tenant, requests)
        now = int(time.time() * 1000)
        for i in ids:
            self.created_ms[i] = now
        return ids


class OtpStream(threading.Thread):
    """Publishes OTPs at a constant arrival rate until stopped; records their ids."""

    def __init__(self, client: SendClient, published: Published, rate: float):
        super().__init__(daemon=True)
        self.client, self.published, self.rate = client, published, rate
        self.ids: list[str] = []
        self.done = threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        n = 0
        while not self.done.is_set():
            self.ids += self.published.add(self.client, OTP_TENANT, [_email("transactional")])
            n += 1
            # Constant arrival rate: wait for the next slot (pacing a load generator, not syncing).
            self.done.wait(max(0.0, start + n / self.rate - time.monotonic()))


class Scenario:
    def __init__(self, fleet: Fleet, provider_rps: int, mock: httpx.Client, progress, baseline: bool = False):
        self.fleet, self.provider_rps, self.mock, self.progress = fleet, provider_rps, mock, progress
        rt = fleet.runtime
        self.published = Published()
        self.client = rt.send_client(router=single_lane(rt.names) if baseline else None)

    def stats(self, deliveries: bool = False) -> dict:
        return self.mock.get("/_mock/stats", params={"deliveries": "1"} if deliveries else None).json()

    def otp_latencies_ms(self, ids: list[str], deliveries: dict) -> list[float]:
        return [deliveries[i][0] * 1000 - self.published.created_ms[i] for i in ids if i in deliveries]

    def blast(self, n: int) -> list[str]:
        ids: list[str] = []
        for start in range(0, n, 1000):
            ids += self.published.add(self.client, BLAST_TENANT, [_email("marketing")] * min(1000, n - start))
        return ids

    def drain(self, ids: set[str], timeout_s: float) -> tuple[set[str], set[str]]:
        """Wait until every id is delivered or dead-lettered; returns (delivered, dead-lettered)."""
        deadline = time.monotonic() + timeout_s
        delivered: set[str] = set()
        dead: set[str] = set()
        while time.monotonic() < deadline:
            delivered = ids & set(self.stats(deliveries=True)["deliveries"])
            if len(delivered) < len(ids):
                dead = {r.send_id for r in read_all(self.fleet.runtime.bootstrap, self.fleet.runtime.names.dlq,
                                                    timeout_s=5)} & ids
            if len(delivered | dead) >= len(ids):
                break
            self.progress(f"draining: {len(delivered)}/{len(ids)} delivered, {len(dead)} dead-lettered")
            time.sleep(1.0)  # polling an external counter while the fleet works
        return delivered, dead


def _scrape(port: int, name: str, **labels) -> float:
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except httpx.HTTPError:
        return 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def run(duration_s: float = 30.0, provider_rps: int = 20, otp_rps: float | None = None,
        storm_s: float = 0.0, latency_ms: float = 50.0, log_dir: Path | None = None,
        progress=lambda msg: None, baseline: bool = True, min_otps: int = MIN_OTPS) -> dict:
    """Each phase lasts at least `duration_s` and long enough for `min_otps` OTPs, so p99 is a
    percentile (not the maximum of a few dozen samples)."""
    otp_rps = otp_rps or provider_rps * 0.2
    if otp_rps > provider_rps * 0.25:
        raise ValueError("the OTP rate must stay within 25% of the provider limit")
    duration_s = max(duration_s, min_otps / otp_rps + 1)
    stamp = int(time.time())
    log_dir = log_dir or Path(f"/tmp/dual-rail-bench-{stamp}")
    blast_n = int(provider_rps * 100 * duration_s)  # what the provider can take in the window
    result: dict = {"duration_s": duration_s, "provider_limit_rps": provider_rps, "otp_rps": otp_rps,
                    "provider_latency_ms": latency_ms, "provider_429_seconds": storm_s, "blast_size": blast_n}

    # ---------------------------------------------------------------- dual lane (the design)
    with Fleet(f"bench{stamp}.", log_dir / "dual-lane", supervise=True, forget=True) as fleet:
        progress("starting the stack: topics, mock provider, workers, retriers, lag monitor")
        metrics_port = free_port()
        start_dispatch(fleet, provider_rps, latency_ms, with_api=False, marketing_metrics_port=metrics_port)
        mock = local_client(base_url=fleet.mock_url, timeout=30)
        s = Scenario(fleet, provider_rps, mock, progress)

        idle_s = max(5.0, min_otps / otp_rps + 1)
        progress(f"idle: OTPs at {otp_rps:g}/s for {idle_s:.0f} s")
        idle = OtpStream(s.client, s.published, otp_rps)
        idle.start()
        time.sleep(idle_s)  # the idle phase lasts this long by definition
        idle.done.set()
        idle.join()

        progress(f"blast: {blast_n} marketing emails while OTPs continue, {duration_s:.0f} s")
        t0 = time.monotonic()
        before: dict | None = None
        warm_at = time.monotonic()
        under = OtpStream(s.client, s.published, otp_rps)
        under.start()
        blast_ids = s.blast(blast_n)
        paused_s, storm_started = 0.0, False
        while time.monotonic() - t0 < duration_s:
            if storm_s and not storm_started and time.monotonic() - t0 >= duration_s / 3:
                mock.post("/_mock/config", json={"throttle_all_for_s": storm_s}).raise_for_status()
                storm_started = True
                progress(f"provider storm: 429 to everything for {storm_s:.0f} s")
            time.sleep(0.5)  # sampling interval of the paused-state gauge
            paused_s += 0.5 * _scrape(metrics_port, "dispatch_lane_paused", lane="marketing", reason="yield")
            st = s.stats()
            if before is None and time.monotonic() - t0 >= WARM_UP_S:
                # Provider use is measured in steady state: the gate's initial burst is excluded.
                before, warm_at = st, time.monotonic()
            progress(f"blast: {st['messages_delivered']} delivered, {st['requests_total']} provider requests")
        after = s.stats()
        before = before or after
        window = time.monotonic() - warm_at
        under.done.set()
        under.join()

        all_ids = set(blast_ids) | set(idle.ids) | set(under.ids)
        delivered, dead = s.drain(all_ids, timeout_s=120 + 2 * storm_s + 90)
        final = s.stats(deliveries=True)
        deliveries = final["deliveries"]
        lat_idle = s.otp_latencies_ms(idle.ids, deliveries)
        lat_blast = s.otp_latencies_ms(under.ids, deliveries)
        used_rps = (after["requests_total"] - before["requests_total"]) / window
        result.update({
            "otp_p50_ms_idle": round(_percentile(lat_idle, 0.5), 1),
            "otp_p99_ms_idle": round(_percentile(lat_idle, 0.99), 1),
            "otp_p50_ms_blast": round(_percentile(lat_blast, 0.5), 1),
            "otp_p99_ms_blast": round(_percentile(lat_blast, 0.99), 1),
            "provider_rps_used_blast": round(used_rps, 2),
            "utilization": round(used_rps / provider_rps, 3),
            "provider_429": final["throttled"],
            "requests_total": final["requests_total"],
            "published": len(all_ids),
            "delivered": len(delivered),
            "dead_lettered": len(dead),
            "dropped": len(all_ids) - len(delivered) - len(dead),
            "duplicate_sends": final["duplicate_deliveries"],
            "marketing_single_requests": final["marketing_single_requests"],
            "marketing_paused_seconds": round(paused_s, 1),
            "otp_count_idle": len(lat_idle), "otp_count_blast": len(lat_blast),
        })

    # ---------------------------------------------------------------- single FIFO lane (naive)
    if baseline:
        with Fleet(f"bench{stamp}b.", log_dir / "single-lane", supervise=True, forget=True) as fleet:
            progress("baseline: one shared FIFO lane, no yielding")
            start_dispatch(fleet, provider_rps, latency_ms, baseline=True, with_api=False)
            mock = local_client(base_url=fleet.mock_url, timeout=30)
            s = Scenario(fleet, provider_rps, mock, progress, baseline=True)
            under = OtpStream(s.client, s.published, otp_rps)
            t0 = time.monotonic()
            under.start()
            s.blast(blast_n)
            while time.monotonic() - t0 < duration_s:
                time.sleep(0.5)
                progress(f"baseline: {s.stats()['messages_delivered']} delivered")
            under.done.set()
            under.join()
            s.drain(set(under.ids), timeout_s=duration_s * 3 + 60)
            lat = s.otp_latencies_ms(under.ids, s.stats(deliveries=True)["deliveries"])
            result["otp_p99_ms_blast_single_lane"] = round(_percentile(lat, 0.99), 1)
            result["otp_p50_ms_blast_single_lane"] = round(_percentile(lat, 0.5), 1)
            result["otp_count_single_lane"] = len(lat)
            result["p99_ratio_single_lane_to_dual_lane"] = round(
                result["otp_p99_ms_blast_single_lane"] / result["otp_p99_ms_blast"], 1)
    return result
