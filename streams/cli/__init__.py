"""The `streams` command: one subcommand per process role or operator task.

Each subcommand is one function that declares its arguments and its handler together: process
roles in `roles`, operator tasks in `operator`, development tools in `dev`.
"""

from __future__ import annotations

import argparse
import sys

from ..errors import DispatchError
from . import dev, operator, roles


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streams", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (roles, operator, dev):
        for register in module.COMMANDS:
            register(sub)
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
