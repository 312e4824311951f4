"""Development tools: the local stack, the mock provider, benchmarks, the fleet and the demo."""

from __future__ import annotations

import argparse
import sys


def dev(sub) -> None:
    p = sub.add_parser("dev", help="local Kafka (KRaft) and Redis on loopback")
    actions = p.add_subparsers(dest="action", required=True)
    up = actions.add_parser("up", help="start (or reuse) the stack; prints KAFKA_BOOTSTRAP_SERVERS and REDIS_URL")
    up.add_argument("--brokers", type=int, choices=[1, 3], default=1,
                    help="3: a three-node KRaft cluster (own ports and data) instead of the single broker; "
                         "also prints DUAL_RAIL_TOPIC_PROFILE=cluster (docs/cluster.md)")
    up.add_argument("--redis-cluster", action="store_true",
                    help="a three-master Redis Cluster instead of the single Redis (REDIS_URL=redis+cluster://...)")
    up.add_argument("--kafka-base-port", type=int, default=None,
                    help="the Kafka cluster's first port (default 29092; node n uses base+2(n-1) and the next)")
    up.add_argument("--redis-base-port", type=int, default=None,
                    help="the Redis Cluster's first port (default 17001; node n uses base+n-1, bus +10000)")
    down = actions.add_parser("down", help="stop the processes this tool started (every node of every cluster)")
    down.add_argument("--wipe", action="store_true", help="also delete Kafka and Redis data")
    actions.add_parser("status", help="report every service and node (exit 3 when one is stopped)")
    kill = actions.add_parser("kill-node", help="stop one node of the local Kafka cluster (or Redis Cluster)")
    kill.add_argument("node", type=int, help="node number, from 1")
    kill.add_argument("--signal", choices=["TERM", "KILL"], default="TERM",
                      help="TERM: a clean shutdown (default); KILL: a crash")
    kill.add_argument("--redis", action="store_true", help="a Redis Cluster node instead of a Kafka node")
    start = actions.add_parser("start-node", help="start one stopped node again and wait until it has rejoined")
    start.add_argument("node", type=int, help="node number, from 1")
    start.add_argument("--redis", action="store_true", help="a Redis Cluster node instead of a Kafka node")
    actions.add_parser("quorum", help="the local Kafka cluster's KRaft controller quorum (leader, voters)")

    def run(args: argparse.Namespace) -> int:
        from ..devtools.stack import LocalStack

        stack = LocalStack()
        if args.action == "up":
            for key, value in _up(stack, args).items():
                print(f"{key}={value}")
        elif args.action == "down":
            stopped, clusters = stack.down(wipe=args.wipe), _clusters()
            for cluster in clusters:
                stopped += cluster.stop()
                if args.wipe:
                    cluster.wipe()
            print(f"stopped: {', '.join(stopped) or 'nothing was running'}" + ("; data wiped" if args.wipe else ""))
        elif args.action in ("kill-node", "start-node"):
            return _node(args)
        elif args.action == "quorum":
            return _quorum()
        else:
            clusters = _clusters()
            statuses = stack.status()
            if clusters:  # the single-node services only when this home uses them
                statuses = [s for s in statuses if s.state != "stopped" or _has_data(stack, s.name)]
            statuses += [s for cluster in clusters for s in cluster.status()]
            width = max([6] + [len(s.name) for s in statuses])
            for s in statuses:
                print(f"{s.name:<{width}} {s.state:<20} {s.address}")
            return 0 if all(s.state != "stopped" for s in statuses) else 3
        return 0

    p.set_defaults(func=run)


def _up(stack, args: argparse.Namespace) -> dict[str, str]:
    from ..devtools.stack import KafkaCluster, LocalRedisCluster
    from ..errors import StackError

    if args.brokers == 1 and not args.redis_cluster:
        if args.kafka_base_port or args.redis_base_port:
            raise StackError("--kafka-base-port goes with --brokers 3, --redis-base-port with --redis-cluster")
        return stack.up()
    if args.kafka_base_port and args.brokers == 1:
        raise StackError("--kafka-base-port goes with --brokers 3")
    if args.redis_base_port and not args.redis_cluster:
        raise StackError("--redis-base-port goes with --redis-cluster")
    # Both layouts are checked against what this home already has before anything starts.
    kafka = KafkaCluster(stack.settings, args.brokers, args.kafka_base_port) if args.brokers > 1 else None
    redis_cluster = LocalRedisCluster(stack.settings, base_port=args.redis_base_port) if args.redis_cluster else None
    redis_url = redis_cluster.start() if redis_cluster else stack.start_redis()
    env = {"KAFKA_BOOTSTRAP_SERVERS": kafka.start() if kafka else stack.start_kafka(), "REDIS_URL": redis_url}
    if kafka:
        env["DUAL_RAIL_TOPIC_PROFILE"] = "cluster"
    return env


def _clusters() -> list:
    from ..devtools.stack import cluster_stacks

    return list(cluster_stacks())


def _has_data(stack, name: str) -> bool:
    return (stack.kafka_data if name == "kafka" else stack.redis_data).exists()


def _node(args: argparse.Namespace) -> int:
    from ..devtools.stack import SIGNALS, KafkaCluster, LocalRedisCluster
    from ..errors import StackError

    cluster: KafkaCluster | LocalRedisCluster | None
    if args.redis:
        cluster, kind, name = LocalRedisCluster.existing(), "Redis Cluster", f"redis-cluster-{args.node}"
    else:
        cluster, kind, name = KafkaCluster.existing(), "Kafka cluster", f"kafka-{args.node}"
    if cluster is None:
        raise StackError(f"this home has no local {kind} (`streams dev up "
                         f"{'--redis-cluster' if args.redis else '--brokers 3'}` starts one)")
    if args.action == "kill-node":
        stopped = cluster.stop_node(args.node, SIGNALS[args.signal])
        print(f"{name} stopped (SIG{args.signal})" if stopped else f"{name} was not running")
        return 0
    cluster.start_node(args.node)
    status = next(s for s in cluster.status() if s.name == name)
    print(f"{name} {status.state} {status.address}")
    return 0


def _quorum() -> int:
    from ..devtools.stack import KafkaCluster
    from ..errors import StackError

    cluster = KafkaCluster.existing()
    if cluster is None:
        raise StackError("this home has no local Kafka cluster (`streams dev up --brokers 3` starts one)")
    q = cluster.quorum()
    print(f"leader {q.leader_id} (epoch {q.leader_epoch}), high watermark {q.high_watermark}")
    for node_id, offset in sorted(q.voters.items()):
        print(f"voter {node_id}: log end offset {offset}" + (" (leader)" if node_id == q.leader_id else ""))
    for node_id, offset in sorted(q.observers.items()):
        print(f"observer {node_id}: log end offset {offset}")
    return 0


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
    p.add_argument("which", choices=["blast-vs-otp", "throughput", "webhooks", "ingest", "latency", "scale"])
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
    p.add_argument("--profile", action="store_true", help="throughput: cProfile the worker (top entries by own time)")
    p.add_argument("--concurrency", type=int, default=8, help="throughput: the worker's requests in flight")
    p.add_argument("--tenant-burst", type=int, default=100,
                   help="throughput: the tenant bucket's burst (100: one batch request per dispatch round)")

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
        elif args.which == "scale":
            from ..devtools.bench_scale import run as scale

            result = scale(n=args.messages, progress=progress)
        elif args.which == "latency":
            from ..devtools.bench_latency import run as latency

            result = latency(n=min(args.messages, 1000), progress=progress)
        elif args.which == "ingest":
            from ..devtools.bench_ingest import run as ingest

            result = ingest(n=min(args.messages, 2000), progress=progress)
        elif args.which == "webhooks":
            from ..devtools.bench_webhooks import run as webhooks

            result = webhooks(deliveries=args.messages, progress=progress)
        else:
            from ..devtools.bench_throughput import run as throughput

            result = throughput(n=args.messages, naive_n=args.naive_messages, progress=progress,
                                profile=args.profile, concurrency=args.concurrency,
                                tenant_burst=args.tenant_burst)
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
