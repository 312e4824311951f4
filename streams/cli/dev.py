"""Development tools: the local stack, the mock provider, benchmarks, the fleet and the demo."""

from __future__ import annotations

import argparse
import sys


def dev(sub) -> None:
    p = sub.add_parser("dev", help="local Kafka (KRaft) and Redis on loopback")
    actions = p.add_subparsers(dest="action", required=True)
    actions.add_parser("up", help="start (or reuse) the stack; prints KAFKA_BOOTSTRAP_SERVERS and REDIS_URL")
    down = actions.add_parser("down", help="stop the processes this tool started")
    down.add_argument("--wipe", action="store_true", help="also delete Kafka and Redis data")
    actions.add_parser("status", help="report both services (exit 3 when one is stopped)")

    def run(args: argparse.Namespace) -> int:
        from ..devtools.stack import LocalStack

        stack = LocalStack()
        if args.action == "up":
            for key, value in stack.up().items():
                print(f"{key}={value}")
        elif args.action == "down":
            stopped = stack.down(wipe=args.wipe)
            print(f"stopped: {', '.join(stopped) or 'nothing was running'}" + ("; data wiped" if args.wipe else ""))
        else:
            statuses = stack.status()
            for s in statuses:
                print(f"{s.name:<6} {s.state:<20} {s.address}")
            return 0 if all(s.state != "stopped" for s in statuses) else 3
        return 0

    p.set_defaults(func=run)


def mock_provider(sub) -> None:
    p = sub.add_parser("mock-provider", help="a Resend-compatible mock provider (and SMS gateway)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=18080)
    p.add_argument("--rate", type=float, default=10.0, help="team-wide requests per second")
    p.add_argument("--latency-ms", type=float, default=0.0)
    p.add_argument("--fault-5xx", type=float, default=0.0, help="ratio of 500 answers")
    p.add_argument("--fault-timeout", type=float, default=0.0, help="ratio of accepted-but-late answers")
    p.add_argument("--timeout-delay", type=float, default=15.0, help="how late a late answer is (s)")
    p.add_argument("--fault-401", type=float, default=0.0, help="ratio of 401 answers")

    def run(args: argparse.Namespace) -> int:
        from ..devtools.mock_provider import MockConfig, serve

        print(f"mock provider on http://{args.host}:{args.port} (team limit {args.rate:g} req/s)", flush=True)
        serve(args.host, args.port, MockConfig(rate=args.rate, latency_ms=args.latency_ms,
                                               fault_5xx_ratio=args.fault_5xx,
                                               fault_timeout_ratio=args.fault_timeout,
                                               fault_401_ratio=args.fault_401, timeout_delay_s=args.timeout_delay))
        return 0

    p.set_defaults(func=run)


def mock_endpoint(sub) -> None:
    p = sub.add_parser("mock-endpoint", help="a webhook receiver that verifies signatures and counts deliveries")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=18090)

    def run(args: argparse.Namespace) -> int:
        from ..devtools.mock_endpoint import serve

        print(f"mock endpoint on http://{args.host}:{args.port}/hooks/<name>", flush=True)
        serve(args.host, args.port)
        return 0

    p.set_defaults(func=run)


def bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks against the local stack (print JSON)")
    p.add_argument("which", choices=["blast-vs-otp", "throughput", "webhooks"])
    p.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    p.add_argument("--verbose", action="store_true", help="progress on stderr even with --json")
    p.add_argument("--duration", type=float, default=30.0, help="blast window, seconds")
    p.add_argument("--provider-rps", type=int, default=20, help="the mock provider's team limit")
    p.add_argument("--otp-rps", type=float, default=None, help="OTPs per second (<= 25%% of the limit)")
    p.add_argument("--latency-ms", type=float, default=50.0, help="mock provider latency")
    p.add_argument("--provider-429-seconds", type=float, default=0.0,
                   help="the provider answers 429 to everything this long, mid-blast")
    p.add_argument("--no-baseline", action="store_true", help="skip the single-lane baseline")
    p.add_argument("--messages", type=int, default=20_000, help="throughput: messages for worker and ceiling")
    p.add_argument("--naive-messages", type=int, default=2_000, help="throughput: messages for the naive loop")

    def run(args: argparse.Namespace) -> int:
        import orjson

        def progress(msg: str) -> None:
            if not args.json or args.verbose:
                print(f"  {msg}", file=sys.stderr, flush=True)

        if args.which == "blast-vs-otp":
            from ..devtools.bench_blast import run as blast

            result = blast(duration_s=args.duration, provider_rps=args.provider_rps, otp_rps=args.otp_rps,
                           storm_s=args.provider_429_seconds, latency_ms=args.latency_ms, progress=progress,
                           baseline=not args.no_baseline)
        elif args.which == "webhooks":
            from ..devtools.bench_webhooks import run as webhooks

            result = webhooks(deliveries=args.messages, progress=progress)
        else:
            from ..devtools.bench_throughput import run as throughput

            result = throughput(n=args.messages, naive_n=args.naive_messages, progress=progress)
        print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
        return 0

    p.set_defaults(func=run)


def fleet(sub) -> None:
    p = sub.add_parser("fleet", help="run the whole dispatch stack (email) until Ctrl-C, e.g. for k6")
    p.add_argument("action", choices=["up"])
    p.add_argument("--baseline", action="store_true", help="the naive design: one FIFO lane, no yielding")
    p.add_argument("--provider-rps", type=int, default=20)
    p.add_argument("--latency-ms", type=float, default=50.0)
    p.add_argument("--env-file", help="write API_URL, BLAST_KEY, OTP_KEY, MOCK_URL here when ready")

    def run(args: argparse.Namespace) -> int:
        import signal
        import tempfile
        import time
        from pathlib import Path

        from ..devtools.fleet import Fleet, start_dispatch

        stop: list[int] = []
        signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
        namespace = f"fleet{int(time.time())}{'b' if args.baseline else ''}."
        with Fleet(namespace, Path(tempfile.mkdtemp(prefix="dual-rail-fleet-")), supervise=True) as f:
            info = start_dispatch(f, args.provider_rps, args.latency_ms, baseline=args.baseline)
            lines = "".join(f"{k}={v}\n" for k, v in info.items())
            if args.env_file:
                Path(args.env_file).write_text(lines)
            print(lines + f"# {'baseline: single FIFO lane' if args.baseline else 'dual lane'}; logs in "
                  f"{f.log_dir}; Ctrl-C stops everything", flush=True)
            try:
                while not stop:
                    time.sleep(0.5)  # this process only waits for Ctrl-C / SIGTERM
            except KeyboardInterrupt:
                pass
        return 0

    p.set_defaults(func=run)


def demo(sub) -> None:
    p = sub.add_parser("demo", help="a short blast-vs-otp demonstration against the local stack")
    p.add_argument("--duration", type=float, default=12.0, help="blast window, seconds")

    def run(args: argparse.Namespace) -> int:
        from ..devtools.demo import main as demo_main

        return demo_main(args.duration)

    p.set_defaults(func=run)


COMMANDS = [dev, mock_provider, mock_endpoint, bench, fleet, demo]
