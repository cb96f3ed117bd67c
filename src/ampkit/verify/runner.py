"""Running one precision of the verify protocol in its own process, and reading its progress.

``run_precision(plan, precision, workdir)`` writes the worker's spec, starts
``python -m ampkit.verify.worker`` (or torchrun with ``nproc``), forwards its ``@ampkit-progress``
lines to a callback, and returns its run record; a crash or a worker killed by the OS becomes a
``failed`` record with the log tail, so the other precisions go on.  Ctrl-C terminates the
worker (kill after 10 s) and propagates.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ampkit._util.procs import die_with_caller
from ampkit._util.version import PACKAGE_DIR
from ampkit.precision import PrecisionName
from ampkit.verify.noise import noise_data_seed
from ampkit.verify.plan import Plan
from ampkit.verify.record import RunRecord, run_record
from ampkit.verify.worker import PROGRESS_PREFIX

__all__ = ["LOG_TAIL_LINES", "NOISE_PART", "ProgressCallback", "run_precision", "tagged"]

LOG_TAIL_LINES = 40


ProgressCallback = Callable[[PrecisionName, dict[str, Any]], None]
"""Called with (precision, event) for each progress line a worker prints."""


def _worker_env(device: torch.device) -> dict[str, str]:
    env = dict(os.environ)
    src = PACKAGE_DIR.parent
    if src.name not in ("site-packages", "dist-packages"):
        # A source tree on sys.path (not installed): workers must import this same ampkit.  An
        # installed one is found anyway, and putting site-packages first could shadow the stdlib.
        env["PYTHONPATH"] = str(src) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONHASHSEED", "0")  # tasks iterating over sets see one order in every run
    if device.type == "cuda":
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # needed for deterministic cuBLAS
    return env


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (killed by the OS: out of memory?)" if name == "SIGKILL" else ""
        return f"the worker process died from {name}{hint}"
    return f"the worker process exited with code {code} without writing a result"


NOISE_PART = "noise"
"""The ``part`` of the noise run's progress events (``ampkit.verify.noise``)."""


def run_precision(p: Plan, precision: PrecisionName, workdir: Path, on_progress: ProgressCallback | None = None,
                  *, nproc: int | None = None, part: int | str = 0) -> RunRecord:
    """Run one precision in a fresh ``python -m ampkit.verify.worker`` process and return its run record.

    With ``nproc`` the worker runs on that many ranks under torchrun (``ampkit.verify.launch``).
    ``part`` is passed on in the progress events (1: the 1-rank scaling baseline; ``NOISE_PART``:
    the fp32 noise run, with its own data order and the shadow loss on the baseline's batches).
    """
    tag = precision if part == 0 else f"{precision}.baseline" if part == 1 else f"{precision}.{part}"
    if on_progress is not None:
        on_progress(precision, tagged({"phase": "launch"}, part))
    spec_path, result_path = workdir / f"{tag}.spec.json", workdir / f"{tag}.result.json"
    spec = {"task": p.task_ref, "precision": precision, "device": str(p.device), "steps": p.steps,
            "warmup": p.warmup, "seed": p.seed, "eval_every": p.eval_every, "result": str(result_path),
            "size": p.size}
    if part == NOISE_PART:
        spec.update(data_seed=noise_data_seed(p.seed), shadow_seed=p.seed)
    if nproc is not None:
        from ampkit.verify.launch import run_torchrun

        def forward(event: dict[str, Any]) -> None:
            if on_progress is not None:
                on_progress(precision, tagged(event, part))

        return run_record(run_torchrun(spec, nproc, workdir, tag, _worker_env(p.device), forward, PROGRESS_PREFIX))
    spec_path.write_text(json.dumps(spec))
    stdout_tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
    with open(workdir / f"{tag}.stderr", "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ampkit.verify.worker", str(spec_path)],
            stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL, text=True, errors="replace", bufsize=1,
            env=_worker_env(p.device), preexec_fn=die_with_caller(),  # SIGKILL of verify: no orphan worker
        )
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith(PROGRESS_PREFIX):
                    if on_progress is not None:
                        on_progress(precision, tagged(json.loads(line[len(PROGRESS_PREFIX):]), part))
                else:
                    stdout_tail.append(line.rstrip("\n"))
            code = proc.wait()
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        with open(workdir / f"{tag}.stderr", errors="replace") as written:
            stderr_tail = written.read().splitlines()[-LOG_TAIL_LINES:]
    log_tail = "\n".join([*stdout_tail, *stderr_tail]) or None
    if result_path.exists():
        result: dict[str, Any] = json.loads(result_path.read_text())
    else:
        result = {"precision": precision, "device": str(p.device), "status": "failed", "error": _describe_exit(code)}
    if result.get("status") != "ok":
        result["log_tail"] = log_tail
    return run_record(result)


def tagged(event: dict[str, Any], part: int | str) -> dict[str, Any]:
    """A progress event of the 1-rank scaling baseline carries ``part: 1``; the main run's carry none."""
    return {**event, "part": part} if part else event
