"""``ampkit doctor``: diagnose a training script or a task.

    ampkit doctor [--json FILE] [--html FILE] [--precision P] [--compare-compiled] SCRIPT [ARGS...]
    ampkit doctor [--json FILE] [--html FILE] [--precision P] -m MODULE [ARGS...]
    ampkit doctor [--json FILE] [--html FILE] [--precision P] TASK

Which one TARGET is:

* an existing file is a SCRIPT, run as ``__main__`` with ARGS as its ``sys.argv[1:]``;
* with ``-m``, TARGET is a module run as ``python -m TARGET ARGS...`` would;
* a path ending in ``.py`` that does not exist is an error (exit 2), never a task;
* anything else is a TASK reference, resolved by ``ampkit.tasks.load_task``: a built-in
  task name, ``path/to/file.py:attr`` or ``package.module:attr``.  A task takes no ARGS.

Options must come before TARGET; everything after it belongs to the script.  Exit status: 130
after Ctrl-C, 143 after SIGTERM and 129 after SIGHUP; else the script's own status when it is not 0 (1 when it
raised); else 1 when an error-severity finding is reported, else 0; 2 for usage errors (a
--json/--html that cannot be written is one, found before the script runs).

When the script is interrupted (Ctrl-C, SIGTERM, SIGHUP), raises, or calls os._exit, the findings
made so far are still printed and written; the JSON then says "partial": true and how it "ended".
A signal that arrives while the files are written waits until they are complete.

A script that calls torch.compile runs eagerly under the doctor (the calls are listed in the
JSON's "compiled"); --compare-compiled then compares the last step compiled vs eager, module by
module, and reports COMPILED_DIVERGENCE for each module that differs beyond its dtype's tolerance.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ampkit.cli.errors import UsageError

__all__ = ["check_outputs", "is_script", "register", "run"]


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
    p.add_argument("--compare-compiled", action="store_true",
                   help="SCRIPT: after the run, compare the last step under torch.compile against eager, module by "
                        "module, and name the modules whose outputs or gradients differ beyond the dtype's tolerance "
                        "(one compile per compared module: seconds each)")
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


def _write_outputs(args: argparse.Namespace, document: dict[str, Any], result: Any, partial: str | None,
                   checkup: dict[str, Any] | None = None) -> None:
    """Write --json and --html; a file that cannot be written goes to the temp directory instead.

    SIGINT, SIGTERM and SIGHUP wait until both are written: the run is over and its findings are
    in memory, and a signal in the middle would leave a temp file and no report (milliseconds).
    """
    from ampkit._util.signals import signals_deferred
    from ampkit.diagnose import write_html, write_json

    with signals_deferred():
        if args.json:
            _write_one("json", args.json, lambda path: write_json(path, document))
        if args.html:
            _write_one("html", args.html, lambda path: write_html(path, result, partial=partial, checkup=checkup))


def _write_one(flag: str, path: Path, write: Callable[[Path], object]) -> None:
    from ampkit._util.outputs import fallback_directory

    try:
        write(path)
    except OSError as exc:
        # The run is done and its findings are in memory: keep them rather than end on a traceback.
        fallback = fallback_directory("ampkit-doctor-") / path.name
        write(fallback)
        print(f"ampkit doctor: could not write --{flag} {path} ({exc.strerror or exc}); wrote {fallback} instead",
              file=sys.stderr)
        return
    print(f"ampkit doctor: wrote {path}", file=sys.stderr)


def check_outputs(args: argparse.Namespace, flags: tuple[str, ...] = ("json", "html")) -> None:
    """Resolve the output options ``flags`` (--json/--html) against the working directory now (a script may
    chdir) and prove each folder writable with a real file, before the script runs."""
    from ampkit._util.outputs import absolute_path, unwritable_reason

    for flag in flags:
        given = getattr(args, flag)
        if given is None:
            continue
        path = absolute_path(given)
        if path.is_dir():
            raise UsageError(f"--{flag} {given!r} is a directory; give a file name")
        if not path.parent.is_dir() and not path.parent.exists():
            raise UsageError(f"--{flag} {given!r}: the folder {str(path.parent)!r} does not exist")
        reason = unwritable_reason(path.parent)
        if reason is not None:
            raise UsageError(f"--{flag} {given!r} cannot be written: {reason}; choose a writable location")
        setattr(args, flag, path)


def run(args: argparse.Namespace) -> int:
    if not args.target:
        raise UsageError("give a training script (ampkit doctor train.py ARGS...), -m MODULE, or a task name")
    _check_precision(args.precision)
    check_outputs(args)
    if is_script(args.target, args.as_module):
        return _run_script(args)
    if args.compare_compiled:
        raise UsageError(f"--compare-compiled compares a script's own step; {args.target!r} is a task, not a "
                         "script file. Pass the training script's path")
    if args.args:
        raise UsageError(f"task {args.target!r} takes no arguments (got {' '.join(args.args)!r}); "
                         "to run a script, pass its path")
    return _run_task(args)


def _run_script(args: argparse.Namespace) -> int:
    from ampkit.diagnose.script.runner import run_script

    try:
        report = run_script(args.target, args.args, module=args.as_module, precision=args.precision,
                            replay=not args.no_replay, checkup=not args.no_checkup,
                            on_os_exit=lambda r: _report_script(args, r), compare_compiled=args.compare_compiled)
    except ModuleNotFoundError as exc:
        raise UsageError(f"-m {args.target}: {exc}") from exc
    return _report_script(args, report)


def _report_script(args: argparse.Namespace, report: Any) -> int:
    """Print and write what the run found (also after Ctrl-C, SIGTERM, SIGHUP, a crash or os._exit); the exit status."""
    from ampkit.diagnose.report.json import doctor_document
    from ampkit.diagnose.report.terminal import render_compiled, render_terminal
    from ampkit.diagnose.script.checkup import checkup_note

    if report.forked_child:  # the parent reports the run; this child's report would replace its files
        print(f"ampkit doctor: process {os.getpid()} is a child the script forked; only the process the doctor "
              "started is reported, so nothing is printed or written for this one", file=sys.stderr)
        return int(report.exit_status)
    how = f"ended by {_ENDED_WORDS[report.ended]}; findings so far" if report.partial else "findings"
    print(f"\nampkit doctor: {report.script} ran {report.steps} optimizer step(s), exit status "
          f"{report.exit_status}; {len(report.findings)} finding(s) ({how})", file=sys.stdout)
    render_compiled(report.compiled, report.compiled_comparison, file=sys.stdout)
    notes = [n for n in (report.mixed_precision.get("summary"), checkup_note(report.checkup)) if n]
    render_terminal(report.findings, file=sys.stdout, note="; ".join(notes) or None)
    if report.steps == 0 and report.tasks and not args.as_module:
        print(f"ampkit doctor: {args.target} ran as a script and trained nothing, but it defines the task "
              f"{report.tasks[0]!r}. To diagnose the task, run: ampkit doctor {args.target}:{report.tasks[0]}",
              file=sys.stderr)
    _write_outputs(args, doctor_document(report), report.result(), report.ended, report.checkup)
    return int(report.doctor_exit_status())


_ENDED_WORDS = {"sigint": "SIGINT (Ctrl-C)", "sigterm": "SIGTERM", "sighup": "SIGHUP (the terminal closed)",
                "exception": "an exception",
                "os_exit": "os._exit"}


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
    from ampkit.diagnose.report.json import doctor_document

    _write_outputs(args, doctor_document(result), result, None)
    return 1 if result.has_errors else 0
