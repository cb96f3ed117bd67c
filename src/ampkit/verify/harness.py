"""The FP32-baseline protocol: run a task under each precision, each in a fresh process, and compare.

``run_verify(config)`` resolves the plan (task, size, device, precisions, steps), records the
environment, runs ``python -m ampkit.verify.worker`` once per precision (sequentially, so the
runs never compete for the device; ``ampkit.verify.runner``), and after the fp32 baseline a
second fp32 run with another data order: the noise run, whose distance to the baseline is the
fp32 noise band (``ampkit.verify.noise``; ``noise_band=False`` leaves it out).  It compares every
run with fp32 (``ampkit.verify.compare``) and returns the ``ampkit.verify/1`` report, whose
verdict is ``pass``, ``fail`` or ``inconclusive``.  Writing the files is
``ampkit.verify.report.write_report``'s job.

With ``nproc`` each precision runs under torchrun on that many DDP ranks instead
(``ampkit.verify.launch``), plus, when ``nproc`` > 1, a 1-rank run of the same precision for the
scaling efficiency.

With ``time_budget`` every precision is first probed for a few steps, and the task size (where
the task has a ladder) and the step count are chosen so that the runs fit
(``ampkit.verify.probe``).  A ``launch`` event precedes each worker, and a ``plan`` event
(precision ``fp32``) carries the budgeted plan, so a caller can estimate the time left.

Ctrl-C stops the running worker (terminate, then kill after 10 s) and propagates; the report
is only written after every run finished, so an interrupted job leaves no partial report.
SIGTERM and SIGHUP, where they have their default action, do the same cleanup (the worker is
stopped, the scratch directory removed), and then the process still dies by that signal
(``ampkit._util.procs.sigterm_unwinds``).
"""

from __future__ import annotations

import math
import signal
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from ampkit._util.procs import sigterm_unwinds
from ampkit._util.signals import DEFERRED_SIGNALS
from ampkit._util.version import __version__
from ampkit.precision import Precision, PrecisionError, PrecisionName, resolve_device
from ampkit.tasks import Task, load_task, split_task_ref
from ampkit.verify.compare import LOSS_DISTANCE_DEFINITION, band_from_runs, compare_runs
from ampkit.verify.noise import BAND_DEFINITION, MIN_RESOLVED_STEPS, NOISE_K, noise_data_seed
from ampkit.verify.plan import Plan, VerifyConfig, VerifyError
from ampkit.verify.record import RunRecord
from ampkit.verify.runner import NOISE_PART, ProgressCallback, run_precision, tagged
from ampkit.verify.shape import resized, run_shape

__all__ = ["SCHEMA", "Plan", "VerifyConfig", "VerifyError", "default_precisions", "plan", "run_verify"]

SCHEMA = "ampkit.verify/1"

_STOP_SIGNALS = tuple(sig for sig in DEFERRED_SIGNALS if sig != signal.SIGINT)
"""The signals that stop a job from outside, where it must still clean up (Ctrl-C's SIGINT already
unwinds, as KeyboardInterrupt)."""


def default_precisions(device: torch.device) -> tuple[PrecisionName, ...]:
    """fp32, bf16 and fp16 on accelerators, plus fp8 where it has fp8 GEMMs and torchao is installed;
    fp32 and bf16 on CPU (fp16 has no fast CPU path; fp8 runs there only when asked).

    >>> default_precisions(torch.device("cpu"))
    ('fp32', 'bf16')
    """
    from ampkit.fp8 import has_fp8_gemm, torchao_installed

    if device.type == "cpu":
        return ("fp32", "bf16")
    candidates: tuple[PrecisionName, ...] = ("fp32", "bf16", "fp16")
    if has_fp8_gemm(device) and torchao_installed():
        candidates += ("fp8",)
    usable: list[PrecisionName] = []
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
    if config.size is not None:
        task = resized(task, config.size)
    _check_nproc(config.nproc, device, task)
    steps, warmup, eval_every = run_shape(config, task)
    requested = config.precisions if config.precisions is not None else default_precisions(device)
    names: list[PrecisionName] = []
    for spec in requested:
        try:
            name = Precision.parse(spec, device).name
        except PrecisionError as exc:
            raise VerifyError(f"--precisions: {exc}") from exc
        if name not in names:
            names.append(name)
    _check_fp8_imports([Precision.parse(n, device) for n in names])
    notes = []
    if config.precisions is None and _fp8_left_out(device):
        notes.append("fp8 is left out of the default precisions: this GPU has fp8 GEMMs but torchao is not "
                     "installed; `pip install 'ampkit[fp8]'` and add --precisions fp32,bf16,fp8")
    if "fp32" not in names:
        notes.append("fp32 added as the baseline every precision is compared with")
    names = ["fp32", *(n for n in names if n != "fp32")]
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
    if not (isinstance(config.noise_k, (int, float)) and 0 < config.noise_k < math.inf):
        raise VerifyError(f"--noise-k {config.noise_k!r}: must be a number > 0 (default {NOISE_K:g})")
    return Plan(task=task, task_ref=ref, device=device, precisions=tuple(names), steps=steps, warmup=warmup,
                eval_every=eval_every, seed=config.seed, notes=tuple(notes), nproc=config.nproc,
                scaling_baseline=config.scaling_baseline, noise_band=config.noise_band,
                size=getattr(task, "size", None))


def _check_fp8_imports(precisions: list[Precision]) -> None:
    # Here, not in the fp8 worker: a torchao that fails to import would otherwise surface only after
    # the fp32 baseline trained, as a raw ImportError.  Costs the import (about 2 s) when fp8 is asked.
    fp8 = [p for p in precisions if p.is_fp8]
    if not fp8:
        return
    from ampkit.fp8 import require_torchao

    try:
        require_torchao(fp8[0])
    except ImportError as exc:
        raise VerifyError(f"--precisions {','.join(p.name for p in fp8)}: {exc}") from exc


def _fp8_left_out(device: torch.device) -> bool:
    from ampkit.fp8 import has_fp8_gemm, torchao_installed

    return has_fp8_gemm(device) and not torchao_installed()


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


def run_verify(config: VerifyConfig, *, on_progress: ProgressCallback | None = None,
               resolved: Plan | None = None) -> dict[str, Any]:
    """Run the protocol and return the ``ampkit.verify/1`` report (nothing is written)."""
    from ampkit.env import collect_environment

    p = resolved if resolved is not None else plan(config)
    environment = collect_environment(full=True, measure=config.measure_env)
    budget: dict[str, Any] | None = None
    # SIGTERM (a scheduler, gpu_check stopping a section) or SIGHUP (a closed terminal) would end
    # the process without unwinding: the worker left running, the scratch directory left in /tmp.
    with sigterm_unwinds(signals=_STOP_SIGNALS), tempfile.TemporaryDirectory(prefix="ampkit-verify-") as tmp:
        if config.time_budget is not None:
            from ampkit.verify.probe import budgeted

            p, budget = budgeted(p, config, float(config.time_budget), Path(tmp), on_progress)
        runs, noise_run = _run_all(p, Path(tmp), on_progress)
    band = band_from_runs(runs[0], noise_run, metrics=dict(p.task.metrics), steps=p.steps, warmup=p.warmup,
                          tol=config.tolerances, k=float(config.noise_k)) if p.noise_band else None
    comparison = compare_runs(runs, metrics=dict(p.task.metrics), steps=p.steps, warmup=p.warmup,
                              tol=config.tolerances, environment=environment, band=band)
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
            "size": p.size,
            "noise_band": {"enabled": p.noise_band, "k": config.noise_k, "min_resolved_steps": MIN_RESOLVED_STEPS,
                           "data_seed": noise_data_seed(p.seed) if p.noise_band else None,
                           "definition": BAND_DEFINITION},
            **({"time_budget": budget} if budget is not None else {}),
        },
        "environment": environment,
        "runs": runs,
        **({"noise": {"run": noise_run, "band": band.to_dict()}} if band is not None else {}),
        "comparison": comparison,
        "verdict": overall_verdict(comparison),
    }


def _run_all(p: Plan, workdir: Path, on_progress: ProgressCallback | None) -> tuple[list[RunRecord],
                                                                                   RunRecord | None]:
    """Every precision's run in order, and the fp32 noise run right after the baseline (or None)."""
    runs: list[RunRecord] = []
    noise_run: RunRecord | None = None
    for precision in p.precisions:
        run = run_precision(p, precision, workdir, on_progress, nproc=p.nproc)
        if p.parts == 2:
            assert p.nproc is not None
            from ampkit.verify.launch import scaling

            baseline = run_precision(p, precision, workdir, on_progress, nproc=1, part=1)
            run["scaling"] = scaling(run, baseline, p.nproc)
        runs.append(run)
        if on_progress is not None:
            on_progress(precision, tagged({"phase": "done", "status": run["status"]}, p.parts - 1))
        if precision == "fp32" and p.noise_band:
            noise_run = run_precision(p, "fp32", workdir, on_progress, nproc=p.nproc, part=NOISE_PART)
            if on_progress is not None:
                on_progress("fp32", tagged({"phase": "done", "status": noise_run["status"]}, NOISE_PART))
    return runs, noise_run


def overall_verdict(comparison: list[dict[str, Any]]) -> str:
    """fail if any run fails, else inconclusive if any run is, else pass."""
    verdicts = {c["verdict"] for c in comparison}
    return "fail" if "fail" in verdicts else "inconclusive" if "inconclusive" in verdicts else "pass"


