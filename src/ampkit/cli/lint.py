"""``ampkit lint``: find AMP mistakes in Python source (rules AMP101–AMP120).

Exit codes: 0 clean, 1 violations (a file that cannot be parsed counts as one, AMP000),
2 usage error (unknown rule code, missing path), a `--fix` that could not be written (the file is
left unchanged and named with the reason), or a path that was not checked while the rest was: a
directory that cannot be listed, a notebook that is not valid JSON, a file edited while `--fix`
rewrote it (not rewritten), a file the linter failed on (each named on stderr).
"""

from __future__ import annotations

import argparse
import os
import sys

from ampkit.cli.errors import UsageError

__all__ = ["register", "run"]

_EPILOG = """\
examples:
  ampkit lint train.py src/
  ampkit lint --select AMP101,AMP113 --format github .
  ampkit lint --fix --select AMP101 src/          # rewrite torch.cuda.amp to torch.amp
  ampkit lint --exclude 'tests/fixtures/,*_pb2.py' .

Silence one line with `# noqa: AMP102` (that rule) or `# noqa` (every rule).
Directories are searched for *.py files (a notebook, .ipynb, is linted when named); virtualenvs (pyvenv.cfg, .venv, venv, site-packages),
.git and __pycache__ are skipped.
"""


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "lint",
        help="find AMP mistakes in Python source",
        description="Find mixed-precision mistakes in Python source without running it.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="files or directories to check")
    parser.add_argument("--format", choices=("text", "json", "github"), default="text",
                        help="text (path:line:col: CODE message), json (ampkit.lint/1) or github "
                             "(workflow annotations); default: text")
    parser.add_argument("--select", metavar="CODES", action="append",
                        help="only these rule codes or prefixes, comma-separated (AMP101,AMP11)")
    parser.add_argument("--ignore", metavar="CODES", action="append",
                        help="skip these rule codes or prefixes, comma-separated")
    parser.add_argument("--exclude", metavar="GLOB", action="append", default=[],
                        help=".gitignore-style pattern(s) to skip, comma-separated, repeatable")
    parser.add_argument("--fix", action="store_true",
                        help="rewrite deprecated torch.cuda.amp / torch.cpu.amp uses (AMP101) in place")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ampkit.lint.checker import lint_paths, parse_codes
    from ampkit.lint.output import render, summary

    try:
        codes = parse_codes(args.select, args.ignore)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    missing = [path for path in args.paths if not os.path.exists(path)]
    if missing:
        raise UsageError(f"no such file or directory: {', '.join(missing)} (pass existing files or directories)")
    report = lint_paths(args.paths, codes, exclude=args.exclude, fix=args.fix)
    sys.stdout.write(render(report, args.format))
    sys.stdout.flush()
    if args.format == "text" or report.fixed:
        print(summary(report), file=sys.stderr)
    for failure in report.unwritten:
        print(f"ampkit lint: could not write the fix, the file is unchanged: {failure}", file=sys.stderr)
    for error in report.errors:
        print(f"ampkit lint: error: {error}", file=sys.stderr)
    for note in report.notes:
        print(f"ampkit lint: note: {note}", file=sys.stderr)
    if report.unwritten or report.errors:
        return 2
    return 1 if report.violations else 0
