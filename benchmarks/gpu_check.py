"""One short run that proves ampkit's CUDA paths, each section judged against a fixed threshold.

    python benchmarks/gpu_check.py [--out DIR] [--only SECTION[,SECTION]]      (or: make gpu-check)

Sections, in order (thresholds in ``gpucheck/table.py`` and docs/gpu-check.md): ``bitexact``,
``nosync``, ``ratios``, ``replay``, ``verify``, ``nccl``, ``frameworks``, and ``fp8``, which only
``--only fp8`` runs (a call with its own budget: its compiles need most of one).  Each runs in its
own process under its own time cap, inside a 4-minute budget for the whole run; a section past its
cap is recorded as "timed out" with the checks it had finished.  Writes ``DIR/gpu-check.json``
(``"schema": "ampkit.gpu-check/1"``), ``DIR/gpu-check.md``, ``DIR/gpu-check.log`` (every section's
output) and ``DIR/verify/`` (the verify section's report); ``DIR`` defaults to ``runs/gpu-check``.

Without a CUDA device it writes a JSON with ``"skipped": "no CUDA device"`` and exits 0: it never
makes up a result.  ``--device cpu --tiny`` runs the sections that do not need CUDA on the CPU at tiny
sizes (what the tests do); the thresholds are meant for the GPU sizes.

Exit status: 0 when no section failed, errored or timed out; 1 otherwise; 2 for bad arguments;
130 when interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
if str(BENCHMARKS) not in sys.path:  # run from elsewhere, or imported by the tests
    sys.path.insert(0, str(BENCHMARKS))

DEFAULT_OUT = Path("runs/gpu-check")


class UsageError(ValueError):
    """Bad arguments: exit status 2 with the message."""


def _sections(only: str | None) -> list[str]:
    from gpucheck.table import SECTIONS

    names = [s.name for s in SECTIONS]
    if only is None:
        return [s.name for s in SECTIONS if s.default]
    asked = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in asked if n not in names]
    if unknown or not asked:
        raise UsageError(f"--only {only!r}: {'unknown section(s) ' + ', '.join(unknown) if unknown else 'no section named'}; "
                         f"choose from {','.join(names)}")
    return [n for n in names if n in asked]  # in run order, each once


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default: runs/gpu-check)")
    ap.add_argument("--only", metavar="SECTION[,SECTION]", help="run only these sections")
    ap.add_argument("--device", default="cuda", help="device for every section (default: cuda)")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes, for a dry run on the CPU")
    ap.add_argument("--section", help=argparse.SUPPRESS)  # a section's own process
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def run_one_section(args: argparse.Namespace) -> int:
    """The child side: run one section and stream its checks into ``--result``."""
    import torch

    from gpucheck.runner import write_checks

    module = importlib.import_module(f"gpucheck.{args.section}")
    kwargs = {"out": args.out} if "out" in inspect.signature(module.run).parameters else {}
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # set_device and NCCL want an index
    write_checks(args.result, module.run(device, tiny=args.tiny, **kwargs))
    return 0


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    try:
        args = parse_args(argv)
        names = _sections(args.only)
        if args.out.exists() and not args.out.is_dir():
            raise UsageError(f"--out {str(args.out)!r} is a file; give a directory (it is created when missing)")
    except UsageError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    if args.section:
        return run_one_section(args)
    try:
        import torch
    except ImportError:
        print(f"gpu_check: {sys.executable} has no torch; run it with the interpreter that holds the CUDA build "
              "(PYTHON=/path/to/python make gpu-check)", file=sys.stderr)
        return 2
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        print(f"gpu_check: --device {args.device!r}: {exc}", file=sys.stderr)
        return 2
    from ampkit.env import collect_environment
    from gpucheck.report import base_report, overall_status, write_report
    from gpucheck.table import TOTAL_BUDGET_S

    if device.type == "cuda" and not torch.cuda.is_available():
        report = base_report(device=args.device, tiny=args.tiny, environment=collect_environment(args.device),
                             budget_s=TOTAL_BUDGET_S)
        report.update(skipped="no CUDA device", complete=True, status="skipped",
                      wall_s=round(time.monotonic() - started, 2))
        json_path, _ = write_report(report, args.out)
        print(f"skipped: no CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda}); wrote {json_path}")
        return 0
    report = base_report(device=str(device), tiny=args.tiny, environment=collect_environment(device, full=True),
                         budget_s=TOTAL_BUDGET_S)
    try:
        return _run_sections(args, names, report, started)
    except KeyboardInterrupt:
        print("gpu_check: interrupted; the report holds the sections that finished", file=sys.stderr)
        return 130
    finally:
        report["wall_s"] = round(time.monotonic() - started, 2)
        report["status"] = overall_status(report["sections"])
        write_report(report, args.out)


def _run_sections(args: argparse.Namespace, names: list[str], report: dict, started: float) -> int:
    from ampkit._util.procs import sigterm_unwinds
    from gpucheck.report import overall_status, write_report
    from gpucheck.runner import MIN_SECTION_S, REPORT_RESERVE_S, not_run, run_section
    from gpucheck.table import TOTAL_BUDGET_S, section

    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "gpu-check.log"
    log.write_bytes(b"")
    device_type = args.device.split(":")[0]
    with sigterm_unwinds():
        for name in names:
            s = section(name)
            left = TOTAL_BUDGET_S - (time.monotonic() - started) - REPORT_RESERVE_S
            if s.needs_cuda and device_type != "cuda":
                entry = not_run(s, "needs CUDA", status="skipped")
            elif left < MIN_SECTION_S:
                entry = not_run(s, f"the {TOTAL_BUDGET_S:.0f} s budget was spent")
            else:
                entry = run_section(s, script=Path(__file__).resolve(), device=args.device, tiny=args.tiny,
                                    out=args.out, limit_s=min(s.cap_s, left), log=log)
            report["sections"].append(entry)
            print(f"{name:<11} {entry['status']:<10} {entry['wall_s']:>7.1f} s"
                  + (f"  {entry['error']}" if entry.get("error") else ""), flush=True)
            report["wall_s"] = round(time.monotonic() - started, 2)
            write_report(report, args.out)  # a killed run keeps the sections that finished
    report["complete"] = True
    status = overall_status(report["sections"])
    print(f"{status}: wrote {args.out / 'gpu-check.json'} and gpu-check.md")
    return 1 if status == "fail" else 0


if __name__ == "__main__":
    sys.exit(main())
