"""The FP32-baseline protocol: run a task under each precision, each in a fresh process, and compare.

``run_verify(config)`` resolves the plan (task, device, precisions, steps), records the
environment, runs ``python -m ampkit.verify.worker`` once per precision (sequentially, so the
runs never compete for the device), reads their progress lines into one progress bar, turns a
crash or a worker killed by the OS into a ``failed`` run while the others go on, compares every
run with fp32 (``ampkit.verify.compare``) and returns the ``ampkit.verify/1`` report.  Writing
the files is ``ampkit.verify.report.write_report``'s job.

With ``nproc`` each precision runs under torchrun on that many DDP ranks instead
(``ampkit.verify.launch``), plus, when ``nproc`` > 1, a 1-rank run of the same precision for the
scaling efficiency.

With ``time_budget`` every precision is first probed for a few steps (``_budgeted``), and the
step count is then shrunk, equally for every precision, so that the runs fit the budget
(``ampkit.verify.budget``).  A ``launch`` event precedes each worker, and a ``plan`` event
(precision ``fp32``) carries the budgeted plan, so a caller can estimate the time left.

Ctrl-C stops the running worker (terminate, then kill after 10 s) and propagates; the report
is only written after every run finished, so an interrupted job leaves no partial report.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from ampkit._util.version import PACKAGE_DIR, __version__
from ampkit.precision import Precision, PrecisionError, resolve_device
from ampkit.tasks import Task, load_task, split_task_ref
from ampkit.verify.budget import (
    BUDGET_SAFETY,
    MIN_STEPS,
    PROBE_STEPS,
    Cost,
    Timeline,
    fit_steps,
    format_duration,
)
from ampkit.verify.compare import LOSS_DISTANCE_DEFINITION, Tolerances, compare_runs
from ampkit.verify.worker import PROGRESS_PREFIX

__all__ = ["SCHEMA", "Plan", "VerifyConfig", "VerifyError", "default_precisions", "plan", "run_verify"]

SCHEMA = "ampkit.verify/1"
LOG_TAIL_LINES = 40


class VerifyError(ValueError):
    """A verify configuration that cannot run; the message says what to change."""


@dataclass(frozen=True, kw_only=True)
class VerifyConfig:
    """What ``ampkit verify`` was asked to do; ``None`` fields take the task's defaults."""

    task: str = "tinygpt"
    """Built-in name, ``path/to/file.py[:attr]`` or ``package.module:attr``."""
    precisions: tuple[str, ...] | None = None
    """Precisions to run; fp32 is always added as the baseline.  None: ``default_precisions``."""
    device: str = "auto"
    """Device for every run (``auto``: cuda, xpu, mps, then cpu)."""
    steps: int | None = None
    """Optimizer steps per run."""
    warmup: int | None = None
    """Steps excluded from throughput (and from the loss-curve distance)."""
    eval_every: int | None = None
    """Evaluate every N steps (and always at the end)."""
    seed: int = 0
    """Seed for the initial weights and the data order, shared by every run."""
    tolerances: Tolerances = field(default_factory=Tolerances)
    """Pass/fail thresholds."""
    measure_env: bool = True
    """Measure matmul throughput per dtype for the environment record (about a second per device)."""
    nproc: int | None = None
    """Ranks per precision under torchrun with DDP (the task's batch split over them); None: one plain process."""
    scaling_baseline: bool = True
    """With ``nproc`` > 1, also run each precision on 1 rank for the scaling efficiency."""
    time_budget: float | None = None
    """Seconds for the probe and the runs together (``--time-budget``): fewer steps, equal for all; None: no limit."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A resolved, validated configuration."""

    task: Task
    task_ref: str
    device: torch.device
    precisions: tuple[str, ...]
    steps: int
    warmup: int
    eval_every: int
    seed: int
    notes: tuple[str, ...] = ()
    nproc: int | None = None
    scaling_baseline: bool = True

    @property
    def parts(self) -> int:
        """Runs per precision: 2 when a 1-rank baseline is run for the scaling efficiency."""
        return 2 if self.nproc is not None and self.nproc > 1 and self.scaling_baseline else 1


def default_precisions(device: torch.device) -> tuple[str, ...]:
    """fp32, bf16 and fp16 on accelerators; fp32 and bf16 on CPU (fp16 has no fast CPU path).

    >>> default_precisions(torch.device("cpu"))
    ('fp32', 'bf16')
    """
    if device.type == "cpu":
        return ("fp32", "bf16")
    candidates = ("fp32", "bf16", "fp16")
    usable = []
    for name in candidates:
        try:
            Precision.parse(name, device)
        except PrecisionError:
            continue
        usable.append(name)
    return tuple(usable)


def _positive(name: str, value: int | None, minimum: int) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        raise VerifyError(f"--{name.replace('_', '-')} {value!r}: must be an integer >= {minimum}")


def plan(config: VerifyConfig) -> Plan:
    """Validate ``config`` against the task and the device (raises ``VerifyError`` / ``TaskLoadError``)."""
    _positive("steps", config.steps, 1)
    _positive("warmup", config.warmup, 0)
    _positive("eval_every", config.eval_every, 1)
    _positive("nproc", config.nproc, 1)
    _check_budget(config)
    try:
        device = resolve_device(config.device)
    except PrecisionError as exc:
        raise VerifyError(str(exc)) from exc
    task = load_task(config.task)
    _check_nproc(config.nproc, device, task)
    steps = config.steps if config.steps is not None else int(getattr(task, "default_steps", 200))
    warmup = config.warmup if config.warmup is not None else min(int(getattr(task, "default_warmup", 10)), steps // 2)
    if warmup >= steps:
        raise VerifyError(f"--warmup {warmup} must be smaller than --steps {steps}: throughput is measured on the "
                          "steps after warm-up")
    eval_every = config.eval_every if config.eval_every is not None else min(
        int(getattr(task, "default_eval_every", 50)), steps)
    requested = config.precisions if config.precisions is not None else default_precisions(device)
    names: list[str] = []
    for spec in requested:
        try:
            name = Precision.parse(spec, device).name
        except PrecisionError as exc:
            raise VerifyError(f"--precisions: {exc}") from exc
        if name not in names:
            names.append(name)
    notes = []
    if "fp32" not in names:
        notes.append("fp32 added as the baseline every precision is compared with")
    names = ["fp32"] + [n for n in names if n != "fp32"]
    unknown = sorted(set(config.tolerances.metric_overrides) - set(task.metrics))
    if unknown:
        raise VerifyError(f"--tol-metric names {', '.join(map(repr, unknown))}, which task {task.name!r} does not "
                          f"report; its metrics: {', '.join(task.metrics)}")
    if config.tolerances.smooth is not None and config.tolerances.smooth < 1:
        raise VerifyError(f"--smooth {config.tolerances.smooth}: the smoothing window must be >= 1 step")
    ref = config.task.strip()
    head, attr = split_task_ref(ref)
    if head.endswith(".py") and Path(head).is_file():
        # Absolute, so that workers resolve the file the same way whatever their working directory.
        ref = str(Path(head).resolve()) + (f":{attr}" if attr else "")
    return Plan(task=task, task_ref=ref, device=device, precisions=tuple(names), steps=steps, warmup=warmup,
                eval_every=eval_every, seed=config.seed, notes=tuple(notes), nproc=config.nproc,
                scaling_baseline=config.scaling_baseline)


def _check_budget(config: VerifyConfig) -> None:
    budget = config.time_budget
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget < float("inf"):
        raise VerifyError(f"--time-budget {budget!r}: must be a number of seconds > 0 (or 90s, 5m, 1h on the CLI)")
    if config.nproc is not None:
        raise VerifyError("--time-budget cannot be combined with --nproc yet (the probe runs one process per "
                          "precision): drop one of them, or set --steps yourself")


def _check_nproc(nproc: int | None, device: torch.device, task: Task) -> None:
    if nproc is None:
        return
    if device.type not in ("cpu", "cuda"):
        raise VerifyError(f"--nproc {nproc} runs DDP with gloo on CPU or nccl on CUDA; device {device.type!r} has "
                          "neither: use --device cpu or cuda, or drop --nproc")
    if device.type == "cuda" and torch.cuda.device_count() < nproc:
        raise VerifyError(f"--nproc {nproc} needs one GPU per rank, but {torch.cuda.device_count()} are visible: "
                          "lower --nproc, or set CUDA_VISIBLE_DEVICES")
    if task.samples_per_batch % nproc:
        raise VerifyError(f"--nproc {nproc} does not divide task {task.name!r}'s batch of {task.samples_per_batch} "
                          "samples (each rank takes an equal slice of it): choose a divisor of the batch size")


ProgressCallback = Callable[[str, dict[str, Any]], None]
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


def run_precision(p: Plan, precision: str, workdir: Path, on_progress: ProgressCallback | None = None, *,
                  nproc: int | None = None, part: int = 0) -> dict[str, Any]:
    """Run one precision in a fresh ``python -m ampkit.verify.worker`` process and return its run record.

    With ``nproc`` the worker runs on that many ranks under torchrun (``ampkit.verify.launch``).
    ``part`` is passed on in the progress events (1: the 1-rank scaling baseline).
    """
    tag = precision if part == 0 else f"{precision}.baseline"
    if on_progress is not None:
        on_progress(precision, _tagged({"phase": "launch"}, part))
    spec_path, result_path = workdir / f"{tag}.spec.json", workdir / f"{tag}.result.json"
    spec = {"task": p.task_ref, "precision": precision, "device": str(p.device), "steps": p.steps,
            "warmup": p.warmup, "seed": p.seed, "eval_every": p.eval_every, "result": str(result_path)}
    if nproc is not None:
        from ampkit.verify.launch import run_torchrun

        def forward(event: dict[str, Any]) -> None:
            if on_progress is not None:
                on_progress(precision, _tagged(event, part))

        return _complete(run_torchrun(spec, nproc, workdir, tag, _worker_env(p.device), forward, PROGRESS_PREFIX))
    spec_path.write_text(json.dumps(spec))
    stdout_tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
    with open(workdir / f"{precision}.stderr", "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ampkit.verify.worker", str(spec_path)],
            stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL, text=True, errors="replace", bufsize=1,
            env=_worker_env(p.device),
        )
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith(PROGRESS_PREFIX):
                    if on_progress is not None:
                        on_progress(precision, _tagged(json.loads(line[len(PROGRESS_PREFIX):]), part))
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
        with open(workdir / f"{precision}.stderr", errors="replace") as written:
            stderr_tail = written.read().splitlines()[-LOG_TAIL_LINES:]
    log_tail = "\n".join([*stdout_tail, *stderr_tail]) or None
    if result_path.exists():
        result: dict[str, Any] = json.loads(result_path.read_text())
    else:
        result = {"precision": precision, "device": str(p.device), "status": "failed", "error": _describe_exit(code)}
    if result.get("status") != "ok":
        result["log_tail"] = log_tail
    return _complete(result)


def _tagged(event: dict[str, Any], part: int) -> dict[str, Any]:
    """A progress event of the 1-rank scaling baseline carries ``part: 1``; the main run's carry none."""
    return {**event, "part": part} if part else event


def _complete(run: dict[str, Any]) -> dict[str, Any]:
    """Give a failed run every key the schema requires, with empty values."""
    defaults: dict[str, Any] = {
        "loss": [], "steps": [], "eval": {}, "eval_history": [], "skipped_steps": 0, "nonfinite_steps": 0,
        "throughput": {}, "peak_memory_bytes": None, "memory": None, "wall_s": None, "init_sha256": None,
        "data_sha256": None, "error": None, "log_tail": None, "world_size": 1,
    }
    for key, value in defaults.items():
        run.setdefault(key, value)
    return run


def run_verify(config: VerifyConfig, *, on_progress: ProgressCallback | None = None,
               resolved: Plan | None = None) -> dict[str, Any]:
    """Run the protocol and return the ``ampkit.verify/1`` report (nothing is written)."""
    from ampkit.env import collect_environment

    p = resolved if resolved is not None else plan(config)
    environment = collect_environment(full=True, measure=config.measure_env)
    runs = []
    budget: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="ampkit-verify-") as tmp:
        if config.time_budget is not None:
            p, budget = _budgeted(p, float(config.time_budget), Path(tmp), on_progress)
        for precision in p.precisions:
            run = run_precision(p, precision, Path(tmp), on_progress, nproc=p.nproc)
            if p.parts == 2:
                assert p.nproc is not None
                from ampkit.verify.launch import scaling

                baseline = run_precision(p, precision, Path(tmp), on_progress, nproc=1, part=1)
                run["scaling"] = scaling(run, baseline, p.nproc)
            runs.append(run)
            if on_progress is not None:
                on_progress(precision, _tagged({"phase": "done", "status": run["status"]}, p.parts - 1))
    comparison = compare_runs(runs, metrics=dict(p.task.metrics), steps=p.steps, warmup=p.warmup,
                              tol=config.tolerances, environment=environment)
    describe = getattr(p.task, "describe", None)
    return {
        "schema": SCHEMA,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "ampkit_version": __version__,
        "task": {
            "name": p.task.name,
            "ref": p.task_ref,
            "metrics": dict(p.task.metrics),
            "samples_per_batch": p.task.samples_per_batch,
            "tokens_per_batch": p.task.tokens_per_batch,
            "info": describe() if callable(describe) else {},
        },
        "protocol": {
            "device": str(p.device),
            "precisions": list(p.precisions),
            "steps": p.steps,
            "warmup": p.warmup,
            "eval_every": p.eval_every,
            "seed": p.seed,
            "tolerances": config.tolerances.to_dict(),
            "loss_distance": LOSS_DISTANCE_DEFINITION,
            "notes": list(p.notes),
            "nproc": p.nproc,
            **({"time_budget": budget} if budget is not None else {}),
        },
        "environment": environment,
        "runs": runs,
        "comparison": comparison,
        "verdict": "pass" if all(c["verdict"] == "pass" for c in comparison) else "fail",
    }


def _budgeted(p: Plan, budget_s: float, workdir: Path, on_progress: ProgressCallback | None) -> tuple[Plan, dict[str, Any]]:
    """Probe every precision for ``PROBE_STEPS`` steps, then shrink the steps equally to fit ``budget_s``.

    The probe is a real worker run (same task, seed, device and precision; one evaluation), so
    its step time includes everything a real step does.  Its own time counts against the budget.
    """
    started = time.perf_counter()
    lines: dict[str, Timeline] = {}
    probe_dir = workdir / "probe"
    probe_dir.mkdir()
    n = min(PROBE_STEPS, p.steps)
    probe = replace(p, steps=n, warmup=min(1, n - 1), eval_every=n)

    def forward(precision: str, event: dict[str, Any]) -> None:
        lines.setdefault(precision, Timeline()).feed(event, time.perf_counter())
        if on_progress is not None:
            on_progress(precision, {**event, "probe": True})

    for precision in p.precisions:
        run_precision(probe, precision, probe_dir, forward)
    probe_s = time.perf_counter() - started
    measured = {name: c for name, c in ((name, line.cost()) for name, line in lines.items()) if c is not None}
    slowest = max(measured.values(), key=lambda c: c.step_s, default=Cost(0.0, 0.0, 0.0))
    costs = {name: measured.get(name, slowest) for name in p.precisions}  # a failed probe: as slow as the slowest
    fit = fit_steps(costs, steps=p.steps, warmup=p.warmup, eval_every=p.eval_every,
                    available_s=(budget_s - probe_s) * BUDGET_SAFETY)
    record: dict[str, Any] = {
        "requested_s": budget_s, "probe_steps": n, "probe_s": round(probe_s, 3), "planned_steps": p.steps,
        "steps": fit.steps, "warmup": fit.warmup, "eval_every": fit.eval_every, "shrunk": fit.steps < p.steps,
        "minimum_steps": min(p.steps, MIN_STEPS), "at_minimum": not fit.fits, "estimate_s": fit.estimate_s,
        "step_s": {k: round(c.step_s, 6) for k, c in costs.items()},
        "costs": {k: {key: round(v, 6) for key, v in c.to_dict().items()} for k, c in costs.items()}}
    record["note"] = _budget_note(record)
    if on_progress is not None:
        on_progress(p.precisions[0], {"phase": "plan", **record})
    return replace(p, steps=fit.steps, warmup=fit.warmup, eval_every=fit.eval_every,
                   notes=(*p.notes, record["note"])), record


def _budget_note(r: dict[str, Any]) -> str:
    times = ", ".join(f"{k} {v:.3g} s" for k, v in r["step_s"].items())
    head = (f"time budget {format_duration(r['requested_s'])}: step times measured by a {r['probe_steps']}-step "
            f"probe of every precision ({format_duration(r['probe_s'])}): {times}")
    if r["at_minimum"]:
        return (f"{head}; even the minimum of {r['steps']} steps per precision does not fit (estimated "
                f"{format_duration(r['estimate_s'])} after the probe): running that minimum, so the job overruns")
    if r["shrunk"]:
        return (f"{head}; every precision runs {r['steps']} steps instead of {r['planned_steps']} (warm-up "
                f"{r['warmup']}, evaluation every {r['eval_every']}), the same steps, data and evaluation for all, "
                f"estimated {format_duration(r['estimate_s'])}")
    return f"{head}; the planned {r['steps']} steps fit (estimated {format_duration(r['estimate_s'])})"
