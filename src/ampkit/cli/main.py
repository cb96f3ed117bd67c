"""``ampkit`` entry point: parse arguments and dispatch to one subcommand module.

Exit codes: 0 success, 1 findings or failed verification, 2 usage or bad input.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from ampkit.cli.errors import UsageError

__all__ = ["SUBCOMMANDS", "UsageError", "build_parser", "main"]

# Each entry is a module under ampkit.cli exposing register(subparsers) and run(args) -> int.
SUBCOMMANDS: tuple[str, ...] = ("doctor", "preflight", "lint", "verify", "env")


def build_parser() -> argparse.ArgumentParser:
    from ampkit._util.version import __version__

    parser = argparse.ArgumentParser(
        prog="ampkit",
        description="Mixed-precision training for PyTorch: train, diagnose, verify, and choose formats before training.",
    )
    parser.add_argument("--version", action="version", version=f"ampkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"ampkit.cli.{name}")
        module.register(sub)
    return parser


def _reject_unknown(parser: argparse.ArgumentParser, command: str | None, extras: list[str]) -> NoReturn:
    """Exit 2 with the usage of the subcommand the unknown arguments followed, and a did-you-mean."""
    target = parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command is not None:
            target = action.choices.get(command, parser)
    options = sorted({opt for action in target._actions for opt in action.option_strings})
    named = []
    for arg in extras:
        flag = arg.split("=", 1)[0]
        close = difflib.get_close_matches(flag, options, n=1) if flag.startswith("-") else []
        named.append(f"{arg} (did you mean {close[0]}?)" if close else arg)
    target.error(f"unrecognized arguments: {' '.join(named)}; see {target.prog} --help")


BROKEN_PIPE_EXIT = 141
"""128 + SIGPIPE, what a shell reports for a writer whose pipe closed."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # parse_args would report an unknown option with the top-level usage, which lists only the
    # subcommands; the subcommand's own usage shows the options the user was reaching for.
    args, extras = parser.parse_known_args(argv)
    if extras:
        _reject_unknown(parser, getattr(args, "command", None), extras)
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return 2
    if sys.stdout is None:  # started with fd 1 closed (`>&-`): the results would have nowhere to go
        print(f"ampkit {args.command}: error: standard output is closed; redirect it to a file or to /dev/null "
              "(`> out.txt`) instead of closing it", file=sys.stderr)
        return 2
    try:
        code = int(args.run(args))
        sys.stdout.flush()  # inside the try: a reader gone by now must not raise at interpreter exit
        return code
    except UsageError as exc:
        print(f"ampkit {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ampkit {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`ampkit env | head`): stop quietly, as a pipe's writer does.  stdout is
        # pointed at /dev/null so the interpreter's final flush does not raise a second time.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return BROKEN_PIPE_EXIT


if __name__ == "__main__":
    sys.exit(main())
