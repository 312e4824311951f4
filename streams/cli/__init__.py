"""The `streams` command: one subcommand per process role or operator task.

Each subcommand is one function that declares its arguments and its handler together: process
roles in `roles`, operator tasks in `operator`, development tools in `dev`.
"""

from __future__ import annotations

import argparse
import sys

from confluent_kafka import KafkaException

from .. import logs
from ..config import Config
from ..errors import AuditUnconfirmed, DispatchError
from . import dev, operator, roles


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streams", description=__doc__.splitlines()[0])
    parser.add_argument("--log-format", choices=["text", "json"], help="log lines as text or JSON (default: "
                        "LOG_FORMAT, else text)")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (roles, operator, dev):
        for register in module.COMMANDS:
            register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.config = Config.from_env()  # every setting parsed once, before anything starts
        logs.setup(args.config.log_level, args.log_format or args.config.log_format)
        return args.func(args)
    except AuditUnconfirmed as exc:
        print(f"warning: {exc}", file=sys.stderr)
        return 4
    except DispatchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KafkaException as exc:
        if args.func.__module__ == roles.__name__:
            raise  # a long-running role's: a bug to find, its traceback kept
        # An operator command's broker call no layer put in our words: said as it is, not a traceback.
        print(f"error: the message broker failed: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
