"""The `streams` command: one subcommand per process role or operator task."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .errors import DispatchError

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

    return demo_main()


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
    demo = sub.add_parser("demo", help="a short demonstration against the local stack")
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
