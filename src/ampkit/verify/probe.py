"""``--time-budget``: probe every precision for a few steps, then pick the task size and the steps that fit.

The probe is a real worker run of each precision (same task, seed and device; ``PROBE_STEPS``
steps and one evaluation), so its step time includes everything a real step does; its own time
counts against the budget.  Costs are modelled per run as ``setup + steps x step + evals x eval``
(``ampkit.verify.budget``); the fp32 noise run costs fp32's plus one forward per step
(``NOISE_STEP_FACTOR``).

**Size ladder.**  A task that offers one (``sizes``, ``resized``: tinygpt) is probed at its
smallest rung, which is cheap on every machine: a 3-step probe of the full tinygpt in emulated
bf16 alone takes a minute and a half on a 2-core AVX2 CPU.  Each larger rung's cost is the
probed one scaled by the ratio of their step FLOPs, times ``EXTRAPOLATION_MARGIN`` (small
matrices run below a CPU's peak, and attention and element-wise work do not scale exactly with
the FLOP count).  The largest rung whose own step count (the one at which its fp32 noise band
resolves the default tolerances) fits is run.  When not even the smallest fits, it runs with
fewer steps, as a task without a ladder does; the verdict then says whether they sufficed.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ampkit.precision import PrecisionName
from ampkit.verify.budget import (
    BUDGET_SAFETY,
    MIN_STEPS,
    PROBE_STEPS,
    Cost,
    Fit,
    Timeline,
    fit_steps,
    format_duration,
)
from ampkit.verify.plan import Plan, VerifyConfig
from ampkit.verify.runner import ProgressCallback, run_precision
from ampkit.verify.shape import at_size

if TYPE_CHECKING:
    from ampkit.tasks import TaskSize

__all__ = ["EXTRAPOLATION_MARGIN", "NOISE_RUN", "NOISE_STEP_FACTOR", "budgeted", "scaled"]

EXTRAPOLATION_MARGIN = 1.5
"""A cost scaled from the probed size to another is taken 1.5x higher: the scaling is a FLOP count."""
NOISE_STEP_FACTOR = 4 / 3
"""The noise run's step is fp32's plus one forward without gradients, about a third of a training step."""
NOISE_RUN = "fp32.noise"
"""The noise run's key in the budget's cost table."""


def scaled(cost: Cost, ratio: float) -> Cost:
    """``cost`` at a size ``ratio`` times the probed one's FLOPs (setup unchanged, margin included)."""
    factor = ratio * EXTRAPOLATION_MARGIN
    return Cost(cost.setup_s, cost.step_s * factor, cost.eval_s * factor)


def budgeted(p: Plan, config: VerifyConfig, budget_s: float, workdir: Path,
             on_progress: ProgressCallback | None) -> tuple[Plan, dict[str, Any]]:
    """The plan that fits ``budget_s`` (size and steps), and the budget record for the report."""
    started = time.perf_counter()
    ladder: tuple[TaskSize, ...] = tuple(getattr(p.task, "sizes", ())) if config.size is None else ()
    probed = at_size(p, config, ladder[-1].name) if ladder else p
    costs, n = _probe(probed, workdir, on_progress)
    probe_s = time.perf_counter() - started
    available = (budget_s - probe_s) * BUDGET_SAFETY
    chosen, run_costs, fit = _choose(p, config, ladder, probed, costs, available)
    record: dict[str, Any] = {
        "requested_s": budget_s, "probe_steps": n, "probe_s": round(probe_s, 3), "planned_steps": chosen.steps,
        "steps": fit.steps, "warmup": fit.warmup, "eval_every": fit.eval_every, "shrunk": fit.steps < chosen.steps,
        "minimum_steps": min(chosen.steps, MIN_STEPS), "at_minimum": not fit.fits, "estimate_s": fit.estimate_s,
        "step_s": {k: round(c.step_s, 6) for k, c in costs.items()},
        "costs": {k: {key: round(v, 6) for key, v in c.to_dict().items()} for k, c in run_costs.items()},
        "probe_size": probed.size, "size": chosen.size,
        "sizes": [s.name for s in ladder]}
    record["note"] = _note(record)
    if on_progress is not None:
        on_progress(p.precisions[0], {"phase": "plan", **record})
    return replace(chosen, steps=fit.steps, warmup=fit.warmup, eval_every=fit.eval_every,
                   notes=(*chosen.notes, record["note"])), record


def _probe(probe_plan: Plan, workdir: Path, on_progress: ProgressCallback | None) -> tuple[dict[str, Cost], int]:
    lines: dict[str, Timeline] = {}
    probe_dir = workdir / "probe"
    probe_dir.mkdir()
    n = min(PROBE_STEPS, probe_plan.steps)
    probe = replace(probe_plan, steps=n, warmup=min(1, n - 1), eval_every=n)

    def forward(precision: PrecisionName, event: dict[str, Any]) -> None:
        lines.setdefault(precision, Timeline()).feed(event, time.perf_counter())
        if on_progress is not None:
            on_progress(precision, {**event, "probe": True})

    for precision in probe.precisions:
        run_precision(probe, precision, probe_dir, forward)
    measured = {name: c for name, c in ((name, line.cost()) for name, line in lines.items()) if c is not None}
    slowest = max(measured.values(), key=lambda c: c.step_s, default=Cost(0.0, 0.0, 0.0))
    return {name: measured.get(name, slowest) for name in probe.precisions}, n  # a failed probe: the slowest


def _with_noise(costs: dict[str, Cost], noise_band: bool) -> dict[str, Cost]:
    if not noise_band or "fp32" not in costs:
        return dict(costs)
    fp32 = costs["fp32"]
    return {**costs, NOISE_RUN: Cost(fp32.setup_s, fp32.step_s * NOISE_STEP_FACTOR, fp32.eval_s)}


def _choose(p: Plan, config: VerifyConfig, ladder: tuple[TaskSize, ...], probed: Plan, costs: dict[str, Cost],
            available: float) -> tuple[Plan, dict[str, Cost], Fit]:
    """The largest rung whose full step count fits, else the probed plan with fewer steps."""
    flops = {s.name: s.step_flops for s in ladder}
    for size in ladder:
        candidate = at_size(p, config, size.name)
        ratio = size.step_flops / flops[str(probed.size)]
        run_costs = _with_noise(costs if size.name == probed.size else
                                {k: scaled(c, ratio) for k, c in costs.items()}, p.noise_band)
        fit = fit_steps(run_costs, steps=candidate.steps, warmup=candidate.warmup, eval_every=candidate.eval_every,
                        available_s=available)
        if fit.steps == candidate.steps and fit.fits:
            return candidate, run_costs, fit
    run_costs = _with_noise(costs, p.noise_band)
    fit = fit_steps(run_costs, steps=probed.steps, warmup=probed.warmup, eval_every=probed.eval_every,
                    available_s=available)
    return probed, run_costs, fit


def _note(r: dict[str, Any]) -> str:
    times = ", ".join(f"{k} {v:.3g} s" for k, v in r["step_s"].items())
    at = f" at size {r['probe_size']!r}" if r["probe_size"] and r["sizes"] else ""
    head = (f"time budget {format_duration(r['requested_s'])}: step times measured by a {r['probe_steps']}-step "
            f"probe of every precision{at} ({format_duration(r['probe_s'])}): {times}")
    if r["sizes"]:
        head += (f"; task size {r['size']!r}" + (" (the largest of " + ", ".join(r["sizes"]) + " that fits)"
                                               if not r["at_minimum"] else ""))
    if r["at_minimum"]:
        return (f"{head}; even the minimum of {r['steps']} steps per precision does not fit (estimated "
                f"{format_duration(r['estimate_s'])} after the probe): running that minimum, so the job overruns")
    if r["shrunk"]:
        return (f"{head}; every precision runs {r['steps']} steps instead of {r['planned_steps']} (warm-up "
                f"{r['warmup']}, evaluation every {r['eval_every']}), the same steps, data and evaluation for all, "
                f"estimated {format_duration(r['estimate_s'])}")
    return f"{head}; the planned {r['steps']} steps fit (estimated {format_duration(r['estimate_s'])})"
