"""The `streams` command: one subcommand per process role or operator task."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .errors import ConfigError, DispatchError
from .lanes import RETRY_TIERS

REPO_TOPICS = Path(__file__).resolve().parent.parent / "topics"


def _topics_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    return REPO_TOPICS if REPO_TOPICS.is_dir() else Path.cwd() / "topics"


# ------------------------------------------------------------------ dev
def cmd_dev(args: argparse.Namespace) -> int:
    from .devstack import LocalStack

    stack = LocalStack()
    if args.action == "up":
        for key, value in stack.up().items():
            print(f"{key}={value}")
    elif args.action == "down":
        stopped = stack.down(wipe=args.wipe)
        print(f"stopped: {', '.join(stopped) or 'nothing was running'}"
              + ("; data wiped" if args.wipe else ""))
    else:
        statuses = stack.status()
        for s in statuses:
            print(f"{s.name:<6} {s.state:<20} {s.address}")
        return 0 if all(s.state != "stopped" for s in statuses) else 3
    return 0


# ------------------------------------------------------------------ topics
def cmd_topics(args: argparse.Namespace) -> int:
    from .settings import StackSettings
    from .topic_admin import TopicAdmin
    from .topic_spec import load_definitions, plan

    specs = load_definitions(_topics_dir(args.dir), namespace=args.namespace)
    admin = TopicAdmin(StackSettings.from_env().bootstrap)
    changes = plan(specs, admin.state(list(specs)))
    if args.action == "plan":
        for change in changes:
            print(change)
        print(f"{len(specs)} topics defined, {len(changes)} change(s) pending")
        return 2 if changes else 0
    refused = [c for c in changes if c.kind == "refused"]
    if refused:
        for change in refused:
            print(change, file=sys.stderr)
        print("nothing applied: fix the definitions or the cluster first", file=sys.stderr)
        return 1
    admin.apply(changes, specs)
    for change in changes:
        print(change)
    print(f"{len(specs)} topics defined, {len(changes)} change(s) applied")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import main as demo_main

    return demo_main(args.duration)


def _run_role(role, metrics_port: int, banner: str) -> int:
    """Run a long-lived role: SIGTERM/SIGINT stop it gracefully; /metrics served; banner printed
    once it is set up (supervisors and tests wait for it)."""
    import signal

    from . import metrics

    signal.signal(signal.SIGTERM, role.stop)
    signal.signal(signal.SIGINT, role.stop)
    metrics.serve(metrics_port)
    print(banner, flush=True)
    role.run()
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from .runtime import Runtime

    _logging()
    worker = Runtime.from_env().worker(args.channel, args.lane, concurrency=args.concurrency, fifo=args.fifo)
    return _run_role(worker, args.metrics_port,
                     f"worker {worker.cfg.worker_id} consuming {worker.topic} as {worker.group}")


def cmd_retrier(args: argparse.Namespace) -> int:
    from .retrier import Retrier, RetrierConfig
    from .runtime import Runtime

    _logging()
    rt = Runtime.from_env()
    retrier = Retrier(RetrierConfig(args.channel, args.lane, args.tier, rt.bootstrap, rt.names,
                                    commit_interval_ms=int(os.environ.get("DUAL_RAIL_COMMIT_INTERVAL_MS", "1000"))))
    return _run_role(retrier, args.metrics_port,
                     f"retrier consuming {retrier.cfg.topic} as {retrier.cfg.group} -> {retrier.lane_topic}")


def cmd_lag_monitor(args: argparse.Namespace) -> int:
    from .lag_monitor import LagMonitor
    from .runtime import Runtime

    _logging()
    rt = Runtime.from_env()
    monitor = LagMonitor(rt.bootstrap, rt.names, interval_s=args.interval)
    return _run_role(monitor, args.metrics_port,
                     f"lag monitor publishing to {rt.names.lag} every {args.interval:g} s")


def cmd_mock_provider(args: argparse.Namespace) -> int:
    from .mock_provider import MockConfig, serve

    _logging()
    print(f"mock provider on http://{args.host}:{args.port} (team limit {args.rate:g} req/s)", flush=True)
    serve(args.host, args.port, MockConfig(rate=args.rate, latency_ms=args.latency_ms,
                                           fault_5xx_ratio=args.fault_5xx, fault_timeout_ratio=args.fault_timeout,
                                           fault_401_ratio=args.fault_401, timeout_delay_s=args.timeout_delay))
    return 0


def cmd_api(args: argparse.Namespace) -> int:
    import uvicorn

    from .api import ApiKeys, create_app
    from .client import SendClient
    from .gate import LimitStore
    from .runtime import Runtime
    from .status_store import StatusStore

    _logging()
    rt = Runtime.from_env()
    r = rt.redis()
    single_lane = os.environ.get("DUAL_RAIL_BASELINE_SINGLE_LANE") == "1"  # benchmark baseline only
    app = create_app(SendClient(rt.bootstrap, rt.names, single_lane=single_lane), StatusStore(r, rt.namespace),
                     ApiKeys(r, rt.namespace), LimitStore(r, rt.namespace), frozenset(rt.policies()))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


def cmd_outcome_recorder(args: argparse.Namespace) -> int:
    import signal

    from .runtime import Runtime
    from .status_store import StatusStore, run_recorder

    from . import metrics

    _logging()
    rt = Runtime.from_env()
    metrics.serve(args.metrics_port)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    run_recorder(rt.bootstrap, StatusStore(rt.redis(), rt.namespace), rt.names.outcomes,
                 f"{rt.namespace}status-recorder", until=lambda: bool(stop))
    return 0


def cmd_limits(args: argparse.Namespace) -> int:
    from .gate import LimitStore
    from .runtime import Runtime

    rt = Runtime.from_env()
    store = LimitStore(rt.redis(), rt.namespace)
    if args.action == "set":
        if args.global_rate or args.global_burst:
            if not (args.global_rate and args.global_burst):
                raise ConfigError("--global-rate and --global-burst go together")
            store.set_provider(args.provider, args.global_rate, args.global_burst, args.reserve)
        if args.tenant:
            if not (args.rate and args.burst):
                raise ConfigError("--tenant needs --rate and --burst")
            store.set_tenant(args.provider, args.tenant, args.rate, args.burst)
    for key, value in store.show(args.provider).items():
        print(f"{args.provider} {key} = {value}")
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    from .api import ApiKeys
    from .runtime import Runtime

    rt = Runtime.from_env()
    keys = ApiKeys(rt.redis(), rt.namespace)
    print(keys.create("operator") if args.operator else keys.create("tenant", args.tenant))
    return 0


def cmd_dlq(args: argparse.Namespace) -> int:
    from . import dlq
    from .runtime import Runtime

    rt = Runtime.from_env()
    records = dlq.read_all(rt.bootstrap, rt.names.dlq)
    if args.action == "list":
        shown = [r for r in records if not args.reason or r.reason == args.reason][-args.limit:]
        for r in shown:
            print(f"{r.send_id:<38} {r.reason:<18} attempts={r.headers.get('attempts', '-'):<3} "
                  f"tenant={r.headers.get('tenant', '-')} lane={r.headers.get('channel', '?')}."
                  f"{r.headers.get('lane', '?')}")
        print(f"{len(shown)} of {len(records)} dead letters")
        return 0
    if not args.send_id:
        raise ConfigError(f"`streams dlq {args.action}` needs a send id")
    record = dlq.find(records, args.send_id)
    if args.action == "show":
        print(dlq.describe(record))
        return 0
    topic = dlq.replay(rt.bootstrap, rt.names, record)
    print(f"replayed {record.send_id} to {topic} as a new attempt record")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import orjson

    def progress(msg: str) -> None:
        if not args.json or args.verbose:
            print(f"  {msg}", file=sys.stderr, flush=True)

    if args.which == "blast-vs-otp":
        from .bench_blast import run

        result = run(duration_s=args.duration, provider_rps=args.provider_rps, otp_rps=args.otp_rps,
                     storm_s=args.provider_429_seconds, latency_ms=args.latency_ms, progress=progress,
                     baseline=not args.no_baseline)
    else:
        from .bench_throughput import run

        result = run(n=args.messages, naive_n=args.naive_messages, progress=progress)
    print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
    return 0


def cmd_fleet(args: argparse.Namespace) -> int:
    import signal
    import tempfile
    import time
    from pathlib import Path

    from .fleet import Fleet, start_dispatch

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    namespace = f"fleet{int(time.time())}{'b' if args.baseline else ''}."
    with Fleet(namespace, Path(tempfile.mkdtemp(prefix="dual-rail-fleet-"))) as fleet:
        info = start_dispatch(fleet, args.provider_rps, args.latency_ms, baseline=args.baseline)
        lines = "".join(f"{k}={v}\n" for k, v in info.items())
        if args.env_file:
            Path(args.env_file).write_text(lines)
        print(lines + f"# {'baseline: single FIFO lane' if args.baseline else 'dual lane'}; logs in "
              f"{fleet.log_dir}; Ctrl-C stops everything", flush=True)
        try:
            while not stop:
                time.sleep(0.5)  # this process only waits for Ctrl-C / SIGTERM
        except KeyboardInterrupt:
            pass
    return 0


def _logging() -> None:
    import logging

    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streams", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    dev = sub.add_parser("dev", help="local Kafka (KRaft) and Redis on loopback")
    dev_sub = dev.add_subparsers(dest="action", required=True)
    dev_sub.add_parser("up", help="start (or reuse) the stack; prints KAFKA_BOOTSTRAP_SERVERS and REDIS_URL")
    down = dev_sub.add_parser("down", help="stop the processes this tool started")
    down.add_argument("--wipe", action="store_true", help="also delete Kafka and Redis data")
    dev_sub.add_parser("status", help="report both services (exit 3 when one is stopped)")
    dev.set_defaults(func=cmd_dev)

    topics = sub.add_parser("topics", help="declarative topics in topics/*.toml")
    topics.add_argument("action", choices=["plan", "apply"])
    topics.add_argument("--dir", help="definition folder (default: the repository's topics/)")
    topics.add_argument("--namespace", default=os.environ.get("DUAL_RAIL_TOPIC_NAMESPACE", ""),
                        help="prefix for every topic name (isolates test runs)")
    topics.set_defaults(func=cmd_topics)
    worker = sub.add_parser("worker", help="a lane worker (run many copies)")
    worker.add_argument("--channel", required=True, choices=["email", "sms", "webhook"])
    worker.add_argument("--lane", required=True, choices=["transactional", "marketing"])
    worker.add_argument("--concurrency", type=int, default=8, help="provider requests in flight")
    worker.add_argument("--metrics-port", type=int, default=0, help="serve /metrics here (0: off)")
    worker.add_argument("--fifo", action="store_true",
                        help="benchmark baseline only: one FIFO queue for all tenants (the naive design)")
    worker.set_defaults(func=cmd_worker)

    retrier = sub.add_parser("retrier", help="re-publish a retry tier's messages to their lane when due")
    retrier.add_argument("--channel", required=True, choices=["email", "sms", "webhook"])
    retrier.add_argument("--lane", required=True, choices=["transactional", "marketing"])
    retrier.add_argument("--tier", required=True, choices=list(RETRY_TIERS))
    retrier.add_argument("--metrics-port", type=int, default=0)
    retrier.set_defaults(func=cmd_retrier)

    lagmon = sub.add_parser("lag-monitor", help="publish transactional lag to notif.lag and /metrics")
    lagmon.add_argument("--interval", type=float, default=0.25, help="seconds between readings (<= 0.5)")
    lagmon.add_argument("--metrics-port", type=int, default=0)
    lagmon.set_defaults(func=cmd_lag_monitor)

    mock = sub.add_parser("mock-provider", help="a Resend-compatible mock provider (and SMS gateway)")
    mock.add_argument("--host", default="127.0.0.1")
    mock.add_argument("--port", type=int, default=18080)
    mock.add_argument("--rate", type=float, default=10.0, help="team-wide requests per second")
    mock.add_argument("--latency-ms", type=float, default=0.0)
    mock.add_argument("--fault-5xx", type=float, default=0.0, help="ratio of 500 answers")
    mock.add_argument("--fault-timeout", type=float, default=0.0, help="ratio of accepted-but-late answers")
    mock.add_argument("--timeout-delay", type=float, default=15.0, help="how late a late answer is (s)")
    mock.add_argument("--fault-401", type=float, default=0.0, help="ratio of 401 answers")
    mock.set_defaults(func=cmd_mock_provider)

    api = sub.add_parser("api", help="the HTTP ingest API")
    api.add_argument("--host", default="127.0.0.1")
    api.add_argument("--port", type=int, default=18000)
    api.set_defaults(func=cmd_api)

    rec = sub.add_parser("outcome-recorder", help="keep the send status store current from notif.outcomes")
    rec.add_argument("--metrics-port", type=int, default=0)
    rec.set_defaults(func=cmd_outcome_recorder)

    limits = sub.add_parser("limits", help="operator: provider and tenant rate limits (in Redis)")
    limits.add_argument("action", choices=["set", "show"])
    limits.add_argument("--provider", required=True, help="resend | sms")
    limits.add_argument("--global-rate", type=int, help="provider requests per second (its real limit)")
    limits.add_argument("--global-burst", type=int)
    limits.add_argument("--reserve", type=int, default=0,
                        help="global tokens marketing may not take (kept for transactional)")
    limits.add_argument("--tenant", help="tenant id, or '*' for the default")
    limits.add_argument("--rate", type=int, help="tenant messages per second")
    limits.add_argument("--burst", type=int)
    limits.set_defaults(func=cmd_limits)

    keys = sub.add_parser("keys", help="operator: create API keys for the ingest API")
    keys.add_argument("action", choices=["create"])
    who = keys.add_mutually_exclusive_group(required=True)
    who.add_argument("--tenant")
    who.add_argument("--operator", action="store_true")
    keys.set_defaults(func=cmd_keys)

    dlq = sub.add_parser("dlq", help="operator: list, show and replay dead letters")
    dlq.add_argument("action", choices=["list", "show", "replay"])
    dlq.add_argument("send_id", nargs="?")
    dlq.add_argument("--reason", help="list only this reason")
    dlq.add_argument("--limit", type=int, default=50)
    dlq.set_defaults(func=cmd_dlq)

    bench = sub.add_parser("bench", help="benchmarks against the local stack (print JSON)")
    bench.add_argument("which", choices=["blast-vs-otp", "throughput"])
    bench.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    bench.add_argument("--verbose", action="store_true", help="progress on stderr even with --json")
    bench.add_argument("--duration", type=float, default=30.0, help="blast window, seconds")
    bench.add_argument("--provider-rps", type=int, default=20, help="the mock provider's team limit")
    bench.add_argument("--otp-rps", type=float, default=None, help="OTPs per second (<= 25%% of the limit)")
    bench.add_argument("--latency-ms", type=float, default=50.0, help="mock provider latency")
    bench.add_argument("--provider-429-seconds", type=float, default=0.0,
                       help="the provider answers 429 to everything this long, mid-blast")
    bench.add_argument("--no-baseline", action="store_true", help="skip the single-lane baseline")
    bench.add_argument("--messages", type=int, default=20_000, help="throughput: messages for worker and ceiling")
    bench.add_argument("--naive-messages", type=int, default=2_000, help="throughput: messages for the naive loop")
    bench.set_defaults(func=cmd_bench)

    fleet = sub.add_parser("fleet", help="run the whole dispatch stack (email) until Ctrl-C, e.g. for k6")
    fleet.add_argument("action", choices=["up"])
    fleet.add_argument("--baseline", action="store_true", help="the naive design: one FIFO lane, no yielding")
    fleet.add_argument("--provider-rps", type=int, default=20)
    fleet.add_argument("--latency-ms", type=float, default=50.0)
    fleet.add_argument("--env-file", help="write API_URL, BLAST_KEY, OTP_KEY, MOCK_URL here when ready")
    fleet.set_defaults(func=cmd_fleet)

    demo = sub.add_parser("demo", help="a short blast-vs-otp demonstration against the local stack")
    demo.add_argument("--duration", type=float, default=12.0, help="blast window, seconds")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except DispatchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
