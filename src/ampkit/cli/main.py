"""``ampkit`` entry point: parse arguments and dispatch to one subcommand module.

Exit codes: 0 success, 1 findings or failed verification, 2 usage or bad input.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ampkit.cli.errors import UsageError

__all__ = ["SUBCOMMANDS", "UsageError", "build_parser", "main"]

# Each entry is a module under ampkit.cli exposing register(subparsers) and run(args) -> int.
SUBCOMMANDS: tuple[str, ...] = ("doctor", "lint", "verify", "env")


def build_parser() -> argparse.ArgumentParser:
    from ampkit._util.version import __version__

    parser = argparse.ArgumentParser(
        prog="ampkit",
        description="Mixed-precision training for PyTorch: train, diagnose, verify.",
    )
    parser.add_argument("--version", action="version", version=f"ampkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"ampkit.cli.{name}")
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.run(args))
    except UsageError as exc:
        print(f"ampkit {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ampkit {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
