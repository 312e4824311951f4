"""The naive design, for the benchmarks only: one shared FIFO lane, no per-tenant queues, no yielding.

`python -m streams.devtools.baseline worker --channel email` runs a lane worker whose queueing
strategy puts every message in one queue and which never yields; `... api --port P` runs the
ingest API with a router that puts every send in the channel's marketing topic. Production code
has no switch for any of this: the strategies are injected here.
"""

from __future__ import annotations

import argparse
import sys

from .. import logs
from ..cli.roles import run_role, serve_api
from ..ingest.sdk import Router
from ..names import TopicNames
from ..runtime import Runtime
from ..send import Send


def one_queue(send: Send) -> str:
    """Every tenant's messages in one FIFO queue: head-of-line blocking, as in the naive design."""
    return "*"


def single_lane(names: TopicNames) -> Router:
    """Every send in the channel's marketing topic, transactional ones included."""
    return lambda send: names.lane(send.channel, "marketing")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m streams.devtools.baseline", description=__doc__)
    sub = parser.add_subparsers(dest="role", required=True)
    worker = sub.add_parser("worker")
    worker.add_argument("--channel", required=True)
    worker.add_argument("--concurrency", type=int, default=8)
    api = sub.add_parser("api")
    api.add_argument("--host", default="127.0.0.1")
    api.add_argument("--port", type=int, default=18000)
    args = parser.parse_args(argv)
    rt = Runtime.from_env()
    logs.setup(rt.config.log_level, rt.config.log_format)
    if args.role == "worker":
        w = rt.worker(args.channel, "marketing", args.concurrency, queue_key=one_queue, yielding=False,
                      backlog=False)
        return run_role(w, "baseline-worker", 0,
                        f"baseline worker {w.cfg.worker_id} consuming {w.topic} as {w.group}", rt.config)
    serve_api(rt, args.host, args.port, router=single_lane(rt.names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
