"""`streams demo` (the Quickstart's `make demo`): a short blast-vs-otp on the local stack, with a
progress line while it runs and a readable summary at the end. Ctrl-C stops everything it started.

Each phase lasts 13 s (at least 48 OTPs, so its p99 is close to the maximum); `streams bench blast-vs-otp`
runs phases of at least 500 OTPs for a p99 that is a percentile."""

from __future__ import annotations

import shutil
import sys

from .bench_blast import run

DEMO_OTPS = 48  # per phase: 12 s at the demo's 4 OTPs a second (and 1 s for the last ones to arrive)


def _progress(msg: str) -> None:
    width = shutil.get_terminal_size((100, 20)).columns - 1
    if sys.stderr.isatty():
        print("\r" + f"  ... {msg}"[:width].ljust(width), end="", file=sys.stderr, flush=True)
    else:
        print(f"  ... {msg}", file=sys.stderr, flush=True)


def main(duration_s: float = 12.0) -> int:
    print("dual-rail dispatch demo: tenant 'blaster' sends a marketing blast at the provider's full\n"
          "limit while tenant 'shop' sends one-time passwords. Same blast, two designs.\n", flush=True)
    r = run(duration_s=duration_s, provider_rps=20, latency_ms=50.0, progress=_progress, min_otps=DEMO_OTPS)
    print("\r", end="", file=sys.stderr)
    ok = r["dropped"] == 0 and r["duplicate_sends"] == 0 and r["marketing_single_requests"] == 0
    print(f"""
  OTP latency, accepted -> at the provider (p50 / p99):
    idle                          {r['otp_p50_ms_idle']:>8.0f} / {r['otp_p99_ms_idle']:<8.0f} ms
    during the blast, dual lane   {r['otp_p50_ms_blast']:>8.0f} / {r['otp_p99_ms_blast']:<8.0f} ms
    during the blast, one lane    {r['otp_p50_ms_blast_single_lane']:>8.0f} / \
{r['otp_p99_ms_blast_single_lane']:<8.0f} ms   (the naive design)

  provider limit {r['provider_limit_rps']} req/s; used {r['provider_rps_used_blast']} req/s during the blast \
(utilization {r['utilization']:.0%}); 429s {r['provider_429']} of {r['requests_total']} requests
  sends published {r['published']}, delivered {r['delivered']}, dead-lettered {r['dead_lettered']}, \
dropped {r['dropped']}, sent twice {r['duplicate_sends']}
  blast requests through the single-email endpoint: {r['marketing_single_requests']} (all went through /emails/batch)

  {'OK' if ok else 'PROBLEM'}: see docs/benchmarks.md for the full benchmark and how to read it.
""")
    return 0 if ok else 1
