"""The error every subcommand raises for bad command-line input (exit status 2, no traceback).

It lives apart from ``ampkit.cli.main`` so that a subcommand module imports it without
importing the dispatcher that loads the subcommands.
"""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(Exception):
    """Bad input from the command line; printed without a traceback, exit code 2."""
