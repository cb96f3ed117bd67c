"""``ampkit doctor``: diagnose a training script or a task.

    ampkit doctor [--json FILE] [--html FILE] [--precision P] SCRIPT [ARGS...]
    ampkit doctor [--json FILE] [--html FILE] [--precision P] -m MODULE [ARGS...]
    ampkit doctor [--json FILE] [--html FILE] [--precision P] TASK

Which one TARGET is:

* an existing file is a SCRIPT, run as ``__main__`` with ARGS as its ``sys.argv[1:]``;
* with ``-m``, TARGET is a module run as ``python -m TARGET ARGS...`` would;
* a path ending in ``.py`` that does not exist is an error (exit 2), never a task;
* anything else is a TASK reference, resolved by ``ampkit.tasks.load_task``: a built-in
  task name, ``path/to/file.py:attr`` or ``package.module:attr``.  A task takes no ARGS.

Options must come before TARGET; everything after it belongs to the script.  Exit status: 1
when an error-severity finding is reported, else the script's own exit status (1 when it
raised an exception the doctor does not explain), 2 for usage errors.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ampkit.cli.errors import UsageError

__all__ = ["is_script", "register", "run"]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="run a training script (or a task) and name the op and module where fp16/bf16 breaks",
        description=(__doc__ or "").replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", metavar="FILE", help="write the findings as ampkit.doctor/1 JSON to FILE")
    p.add_argument("--html", metavar="FILE", help="write a self-contained HTML report (headroom chart) to FILE")
    p.add_argument("--precision", metavar="P", default=None,
                   help="SCRIPT: precision the checkup diagnoses when the script never enables autocast; "
                        "TASK: precision to diagnose (default: auto, the engine's choice for the device)")
    p.add_argument("-m", dest="as_module", action="store_true", help="TARGET is a module, run like python -m")
    p.add_argument("--no-replay", action="store_true",
                   help="SCRIPT: observe only; do not replay failing steps op by op")
    p.add_argument("--no-checkup", action="store_true",
                   help="SCRIPT: when no step failed, skip the op-level checkup of the last step")
    p.add_argument("target", metavar="SCRIPT|TASK", nargs="?", help="training script, module (-m) or task reference")
    p.add_argument("args", metavar="ARGS", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(run=run)


def _check_precision(name: str | None) -> None:
    if name is None:
        return
    from ampkit.precision import PRECISION_ALIASES

    if name.strip().lower() not in PRECISION_ALIASES:
        raise UsageError(f"--precision {name!r} is not known; use one of {', '.join(PRECISION_ALIASES)}")


def is_script(target: str, as_module: bool) -> bool:
    """True for SCRIPT mode (see the module docstring); raises UsageError for a missing ``.py`` path."""
    if as_module:
        return True
    if Path(target).is_file():
        return True
    if target.endswith(".py"):
        raise UsageError(f"no such script: {target!r} (for a task defined in a file, use {target}:ATTR)")
    if Path(target).is_dir():
        raise UsageError(f"{target!r} is a directory; pass the training script inside it, or -m package.module")
    return False


def _write_outputs(args: argparse.Namespace, result: Any, findings: list[Any], environment: dict[str, Any]) -> None:
    from ampkit.diagnose import write_html, write_json

    if args.json:
        write_json(args.json, result, environment)
        print(f"ampkit doctor: wrote {args.json}", file=sys.stderr)
    if args.html:
        write_html(args.html, result)
        print(f"ampkit doctor: wrote {args.html}", file=sys.stderr)


def _check_outputs(args: argparse.Namespace) -> None:
    for flag in ("json", "html"):
        path = getattr(args, flag)
        if path is not None and Path(path).is_dir():
            raise UsageError(f"--{flag} {path!r} is a directory; give a file name")
        if path is not None and not Path(path).resolve().parent.is_dir():
            raise UsageError(f"--{flag} {path!r}: the folder {str(Path(path).resolve().parent)!r} does not exist")


def run(args: argparse.Namespace) -> int:
    if not args.target:
        raise UsageError("give a training script (ampkit doctor train.py ARGS...), -m MODULE, or a task name")
    _check_precision(args.precision)
    _check_outputs(args)
    if is_script(args.target, args.as_module):
        return _run_script(args)
    if args.args:
        raise UsageError(f"task {args.target!r} takes no arguments (got {' '.join(args.args)!r}); "
                         "to run a script, pass its path")
    return _run_task(args)


def _run_script(args: argparse.Namespace) -> int:
    from ampkit.diagnose.report.terminal import render_terminal
    from ampkit.diagnose.script.runner import run_script

    report = run_script(args.target, args.args, module=args.as_module, precision=args.precision,
                        replay=not args.no_replay, checkup=not args.no_checkup)
    print(f"\nampkit doctor: {report.script} ran {report.steps} optimizer step(s), exit status "
          f"{report.exit_status}; {len(report.findings)} finding(s)", file=sys.stdout)
    render_terminal(report.findings, file=sys.stdout)
    _write_outputs(args, report.result(), report.findings, report.environment())
    if report.has_errors:
        return 1
    return report.exit_status


def _run_task(args: argparse.Namespace) -> int:
    from ampkit.diagnose.report.terminal import render_terminal
    from ampkit.diagnose.task import diagnose_task
    from ampkit.tasks import load_task

    try:
        task = load_task(args.target)
    except (ValueError, LookupError, ImportError, OSError) as exc:
        raise UsageError(f"cannot load task {args.target!r}: {exc}") from exc
    result = diagnose_task(task, args.precision or "auto")
    render_terminal(result.findings, file=sys.stdout)
    _write_outputs(args, result, result.findings, result.environment or {})
    return 1 if result.has_errors else 0
