"""`python -m streams.devtools.blaster --count N`: a marketing blaster as its own process, publishing
N marketing emails of one tenant through the SDK in batches of 1,000 (the environment names the
broker and the topic namespace). Benchmarks run it beside their measured producer, as a real
blast comes from another producer than the OTPs do: in one process the two would share the GIL and
the blast's encoding would be measured as the OTPs' ingest time."""

from __future__ import annotations

import argparse

from ..runtime import Runtime
from .bench_blast import _email


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="blaster")
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--tenant", default="blaster")
    args = p.parse_args(argv)
    rt = Runtime.from_env()
    client = rt.send_client()
    print(f"blaster publishing {args.count} marketing emails", flush=True)
    try:
        for start in range(0, args.count, 1000):
            client.publish_batch(args.tenant, [_email("marketing")] * min(1000, args.count - start))
    finally:
        rt.close()
    print("blaster done", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
