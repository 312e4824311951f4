"""Long-lived process roles: lane workers, retriers, the lag monitor, the ingest API, the
outcome recorder and the endpoint-health app. Each can run as many copies as needed."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import metrics
from ..backoff import Outage
from ..config import Config, is_duration
from ..cpu_priority import lower_own_priority
from ..lag.monitor import MAX_INTERVAL_S
from ..lanes import CHANNELS, LANES, RETRY_TIERS
from ..runtime import Runtime

log = logging.getLogger("streams.roles")


def run_role(role: Any, name: str, metrics_port: int, banner: str, config: Config) -> int:
    """Run a long-lived role: SIGTERM/SIGINT stop it gracefully; /metrics served, saying the role's `name`; the
    banner is printed once it is set up (supervisors and tests wait for it)."""
    signal.signal(signal.SIGTERM, role.stop)
    signal.signal(signal.SIGINT, role.stop)
    metrics.announce(name)
    metrics.serve(metrics_port, config.metrics_addr)
    print(banner, flush=True)
    role.run()
    return 0


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(0)

# The API server's own lines (warnings and errors; no access log) go through this process's log handler
# (`log_config=None`: uvicorn installs none of its own), so a failure it logs with its traceback is in the
# process's format, with the text of the exception withheld as in every other line (logs.TEXT_SHOWN).
UVICORN_LOGGING: dict[str, Any] = {"log_level": "warning", "access_log": False, "log_config": None}


def serve_api(rt: Runtime, host: str, port: int, router=None, log_format: str | None = None,
              bulk_socket: str | None = None, bulk_instance: str | None = None, bulk_parent: int | None = None) -> None:
    """The ingest API on host:port; batches are forwarded to a bulk process it starts and keeps running
    (ingest/bulk.py) unless DUAL_RAIL_INGEST_BULK=off or a `router` is given (the baseline's single
    lane). With `bulk_socket`, this *is* the bulk process: the same app on that Unix socket."""
    import uvicorn

    from ..gate.gate import RedisGate
    from ..ingest.api import Ingest, create_app
    from ..ingest.bulk import BULK_VIEW_SYNC_S, BulkProcess, die_with_parent, remove_socket
    from ..ingest.idempotency import IngestIdempotency
    from ..ingest.quotas import IngestQuotas
    from ..ingest.status import StatusStore

    metrics.announce("baseline-api" if router is not None else "api-bulk" if bulk_socket is not None else "api")
    bulk = None
    bulk_nice = rt.config.ingest_bulk_nice if bulk_socket is None and router is None else None
    if bulk_nice is not None or bulk_socket is not None:
        # uvicorn raises SIGTERM again once it has shut down; as SystemExit, `finally` below still
        # stops the bulk process and removes its socket's directory.
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if bulk_parent is not None:
        die_with_parent(bulk_parent)
    try:
        if bulk_nice is not None:  # it starts while this process sets itself up
            bulk = BulkProcess(bulk_nice, log_format, rt.config.ingest_instance)
            bulk.start()
        r = rt.redis()
        guard = rt.state_guard("api", r)
        client = rt.send_client(router=router, txn_instance=bulk_instance)
        # The guard is read at most every few seconds; a claim that finds a slot lost makes it look again at once.
        store = StatusStore(r, rt.namespace, holds_data=guard.check, on_lost=guard.recheck)
        if bulk_instance is not None:
            _fence_predecessor(client.publisher)
        webhooks = rt.webhook_ingest(r, client, store)
        if bulk_socket is not None:
            webhooks.sync_view_s = BULK_VIEW_SYNC_S
        webhooks.follow()
        app = create_app(Ingest(client, store, rt.api_keys(r), rt.limit_store(r), frozenset(rt.policies()),
                                quotas=IngestQuotas(RedisGate(r, rt.namespace)),
                                idempotency=IngestIdempotency(r, rt.namespace), audit=rt.audit_log(),
                                guard=guard, webhooks=webhooks,
                                senders=rt.sender_store(r), registry=rt.config.registry),
                         bulk_socket=bulk.socket_path if bulk else None)
        if bulk is not None:
            bulk.wait_ready()
        if bulk_socket is not None:
            uvicorn.run(app, uds=bulk_socket, **UVICORN_LOGGING)
        else:
            uvicorn.run(app, host=host, port=port, **UVICORN_LOGGING)
    finally:
        if bulk is not None:
            bulk.stop()
        if bulk_socket is not None:  # also when the API process was killed: it would leave the directory
            remove_socket(bulk_socket, bulk_parent)


def _fence_predecessor(publisher) -> None:
    """Start every transactional producer of the bulk process now: each aborts what a crashed
    predecessor left open under its id. While the broker refuses, keep trying in the background
    (a batch meanwhile starts the producer it needs itself)."""
    from ..errors import PublishError

    def until_done() -> None:
        outage = Outage("the bulk process's transactional producers", base_s=1.0, cap_s=30.0)
        while True:
            try:
                publisher.open_pool()
            except PublishError as exc:
                time.sleep(max(0.0, outage.failed(time.monotonic(), exc) - time.monotonic()))  # backoff, not sync
            else:
                outage.recovered(time.monotonic())
                return

    try:
        publisher.open_pool()
    except PublishError as exc:
        log.warning("cannot start the transactional producers yet (%s); trying again in the background", exc)
        threading.Thread(target=until_done, name="fence-predecessor", daemon=True).start()


def _count(text: str) -> int:
    """An argument counting something: a whole number, at least 1 (argparse names the option)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _seconds(most: float | None = None) -> Callable[[str], float]:
    """An argument that is a number of seconds above 0 (and at most `most`); argparse names the option."""
    def seconds(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not is_duration(value) or (most is not None and value > most):
            raise argparse.ArgumentTypeError(f"{text} must be a number of seconds above 0"
                                             + (f" and at most {most:g}" if most is not None else ""))
        return value
    return seconds


def _metrics_port(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=int, default=0, help="serve /metrics here (0: off)")


def yield_cpu_if_marketing(rt: Runtime, lane: str) -> None:
    """A marketing role runs at a lower CPU priority (nice DUAL_RAIL_MARKETING_NICE, 10 by default):
    where both lanes share a host, a blast's CPU use never delays an OTP, as its provider tokens never do."""
    if lane == "marketing" and rt.config.marketing_nice:
        lower_own_priority(rt.config.marketing_nice)


def worker(sub) -> None:
    p = sub.add_parser("worker", help="a lane worker (run many copies)")
    p.add_argument("--channel", required=True, choices=CHANNELS)
    p.add_argument("--lane", required=True, choices=LANES)
    p.add_argument("--concurrency", type=_count, default=None,
                   help="provider requests in flight (default: transactional, the provider's `concurrency` "
                        "in providers.toml; marketing 8; webhooks 1024, whose receivers are slow)")
    _metrics_port(p)

    def run(args: argparse.Namespace) -> int:
        rt = Runtime(args.config)
        yield_cpu_if_marketing(rt, args.lane)
        w = rt.worker(args.channel, args.lane, concurrency=args.concurrency)
        return run_role(w, f"worker.{args.channel}.{args.lane}", args.metrics_port,
                        f"worker {w.cfg.worker_id} consuming {w.topic} as {w.group}", rt.config)

    p.set_defaults(func=run)


def retrier(sub) -> None:
    p = sub.add_parser("retrier", help="re-publish a lane's retry messages (every tier) when each is due")
    p.add_argument("--channel", required=True, choices=CHANNELS)
    p.add_argument("--lane", required=True, choices=LANES)
    p.add_argument("--tier", choices=list(RETRY_TIERS),
                   help="ignored: one retrier serves every tier of its lane (kept so old commands still run)")
    _metrics_port(p)

    def run(args: argparse.Namespace) -> int:
        rt = Runtime(args.config)
        if args.tier:
            logging.getLogger("streams.retrier").warning(
                "--tier %s is ignored: this retrier serves every tier of %s.%s", args.tier, args.channel, args.lane)
        yield_cpu_if_marketing(rt, args.lane)
        r = rt.retrier(args.channel, args.lane)
        return run_role(r, f"retrier.{args.channel}.{args.lane}", args.metrics_port,
                        f"retrier consuming {len(r.cfg.topics)} tiers of {args.channel}.{args.lane} as {r.cfg.group} "
                        f"-> {r.lane_topic}", rt.config)

    p.set_defaults(func=run)


def lag_monitor(sub) -> None:
    p = sub.add_parser("lag-monitor", help="publish transactional lag to notif.lag and /metrics")
    p.add_argument("--interval", type=_seconds(most=MAX_INTERVAL_S), default=0.25,
                   help=f"seconds between readings (<= {MAX_INTERVAL_S:g})")
    p.add_argument("--retry-watch-every", type=_seconds(), default=5.0,
                   help="seconds between measurements of the retry tiers")
    _metrics_port(p)

    def run(args: argparse.Namespace) -> int:
        from ..lag.monitor import LagMonitor

        rt = Runtime(args.config)
        monitor = LagMonitor(rt.bootstrap, rt.names, interval_s=args.interval,
                             retry_watch_every_s=args.retry_watch_every)
        return run_role(monitor, "lag-monitor", args.metrics_port,
                        f"lag monitor publishing to {rt.names.lag} every {args.interval:g} s", rt.config)

    p.set_defaults(func=run)


def api(sub) -> None:
    p = sub.add_parser("api", help="the HTTP ingest API")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=18000)
    # Used by the API to start its bulk process (ingest/bulk.py); not for people.
    p.add_argument("--bulk-socket", help=argparse.SUPPRESS)
    p.add_argument("--bulk-instance", help=argparse.SUPPRESS)
    p.add_argument("--bulk-parent", type=int, help=argparse.SUPPRESS)

    def run(args: argparse.Namespace) -> int:
        rt = Runtime(args.config)
        serve_api(rt, args.host, args.port, log_format=args.log_format, bulk_socket=args.bulk_socket,
                  bulk_instance=args.bulk_instance, bulk_parent=args.bulk_parent)
        return 0

    p.set_defaults(func=run)


def outcome_recorder(sub) -> None:
    p = sub.add_parser("outcome-recorder", help="keep the send status store current from notif.outcomes")
    _metrics_port(p)

    def run(args: argparse.Namespace) -> int:
        from ..ingest.status import OutcomeRecorder, StatusStore

        rt = Runtime(args.config)
        r = rt.redis()
        recorder = OutcomeRecorder(rt.bootstrap, StatusStore(r, rt.namespace), rt.names.outcomes,
                                   rt.names.recorder_group, guard=rt.state_guard("outcome recorder", r))
        return run_role(recorder, "outcome-recorder", args.metrics_port,
                        f"outcome recorder consuming {rt.names.outcomes}", rt.config)

    p.set_defaults(func=run)


def endpoint_health(sub) -> None:
    p = sub.add_parser("endpoint-health", help="the faust-streaming app keeping webhook endpoint health "
                                               "(degradation, alert emails); run one or more copies")
    p.add_argument("--data-dir", default=None, help="faust's working directory (default: a temporary one)")
    _metrics_port(p)

    def run(args: argparse.Namespace) -> int:
        
        from ..health.app import EndpointHealthApp

        rt = Runtime(args.config)
        metrics.announce("endpoint-health")
        metrics.serve(args.metrics_port, rt.config.metrics_addr)
        app = EndpointHealthApp(rt.config, rt.endpoint_directory(), Path(args.data_dir) if args.data_dir else None)
        return app.run(f"endpoint health consuming {rt.names.webhook_attempts} as {rt.names.endpoint_health_app}")

    p.set_defaults(func=run)


COMMANDS = [worker, retrier, lag_monitor, api, outcome_recorder, endpoint_health]
