"""Each section in its own process, under its time cap and the run's overall budget.

A process per section, because a hang inside a CUDA kernel or an NCCL collective cannot be
interrupted from Python: past its cap the section's process group gets SIGTERM, then SIGKILL, and the
section is recorded as "timed out" with the checks it had finished (the section writes each check to
its result file as soon as it has it).  A process per section also gives each a fresh CUDA context:
peak-memory counters, sync-debug mode and a sticky CUDA error stay in the section that made them.
The cost is one interpreter and CUDA start-up per section (seconds; inside each section's cap).
If the check itself is killed (SIGKILL included), the section's process dies with it (parent-death
signal), and SIGTERM or Ctrl-C stop the running section before the check exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ampkit._util.jsonfloat import NONFINITE_AS_STRING, dumps
from ampkit._util.procs import die_with_caller, signal_groups
from gpucheck.table import Section

__all__ = ["MIN_SECTION_S", "REPORT_RESERVE_S", "not_run", "run_section", "section_status", "write_checks"]

REPORT_RESERVE_S = 5.0
"""Kept back from the budget for writing the report after the last section."""
MIN_SECTION_S = 5.0
"""A section is not started with less time than this left in the budget."""
KILL_GRACE_S = 3.0
SECTION_ENV = {
    # cuBLAS is deterministic with a fixed workspace only; bitexact turns deterministic algorithms on.
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "PYTHONUNBUFFERED": "1",
}


def section_status(checks: list[dict[str, Any]]) -> str:
    """A section's status from its checks: fail/error beat pass, pass beats reported, all skipped is skipped."""
    statuses = {c["status"] for c in checks}
    for worst in ("error", "fail"):
        if worst in statuses:
            return worst
    if "pass" in statuses:
        return "pass"
    if "reported" in statuses:
        return "reported"
    return "skipped" if statuses else "error"


def _read_checks(path: Path) -> tuple[list[dict[str, Any]], str | None, bool]:
    """The checks a section wrote, its error line if it wrote one, and whether it finished them all.

    A half-written last line (a section killed mid-write) is dropped.
    """
    checks: list[dict[str, Any]] = []
    error, done = None, False
    if not path.exists():
        return checks, error, done
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "key" in item:
            checks.append(item)
        elif "error" in item:
            error = item["error"]
        elif item.get("done"):
            done = True
    return checks, error, done


def _exit_text(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {-code} ({signal.Signals(-code).name})"
        return f"signal {-code}"
    return f"status {code}"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the section's process group, then SIGKILL after a grace period."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        signal_groups([proc.pid], sig)
        try:
            proc.wait(timeout=KILL_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def run_section(section: Section, *, script: Path, device: str, tiny: bool, out: Path, limit_s: float,
                log: Path) -> dict[str, Any]:
    """Run ``section`` in a child process of ``script`` for at most ``limit_s``; returns its report entry."""
    result = out / f".{section.name}.result.jsonl"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, str(script), "--section", section.name, "--device", device, "--out", str(out),
           "--result", str(result), *(["--tiny"] if tiny else [])]
    env = {**os.environ, **SECTION_ENV}
    started = time.monotonic()
    timed_out = False
    with log.open("ab") as sink:
        sink.write(f"\n===== {section.name} (cap {limit_s:.0f} s) =====\n".encode())
        sink.flush()
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=die_with_caller())
        try:
            proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            if proc.returncode is None:
                _stop(proc)
    wall = time.monotonic() - started
    checks, error, done = _read_checks(result)
    result.unlink(missing_ok=True)
    if timed_out:
        status = "timed out"
        error = f"killed after its cap of {limit_s:.0f} s; {len(checks)} check(s) had finished"
    elif proc.returncode != 0:
        status = "error"
        if error is None and done:
            error = (f"every check finished, then the section's process ended with {_exit_text(proc.returncode)} "
                     f"while shutting down; see {log.name}")
        error = error or f"the section's process ended with {_exit_text(proc.returncode)}; see {log.name}"
    else:
        status = section_status(checks)
    return {"name": section.name, "what": section.what, "status": status, "cap_s": section.cap_s,
            "limit_s": round(limit_s, 1), "wall_s": round(wall, 2), "error": error, "checks": checks}


def not_run(section: Section, why: str, *, status: str = "not run") -> dict[str, Any]:
    """The report entry of a section that was not started (``status``: "not run" or "skipped")."""
    return {"name": section.name, "what": section.what, "status": status, "cap_s": section.cap_s,
            "limit_s": 0.0, "wall_s": 0.0, "error": why, "checks": []}


def write_checks(result: Path, checks: Iterator[Any]) -> None:
    """Section side: append each check as one JSON line the moment it is made (kept if the section is killed)."""
    with result.open("a", encoding="utf-8") as f:
        try:
            for c in checks:
                f.write(dumps(c.to_json(), NONFINITE_AS_STRING) + "\n")
                f.flush()
        except Exception as exc:
            f.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
            f.flush()
            raise
        f.write(json.dumps({"done": True}) + "\n")
