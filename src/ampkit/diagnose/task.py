"""``diagnose_task``: the doctor on a Task (``ampkit doctor TASK``).

A Task (``ampkit.tasks``) builds a model, an optimizer, batches and a loss.  The
diagnosis:

1. diagnoses the first batch with ``diagnose_step`` (op-level trace, FP32 shadow, bisection,
   headroom), at the scale the engine would use;
2. trains ``steps`` steps with ``MixedPrecision(precision, doctor=True)``, so any step that is
   skipped or goes non-finite later is replayed and diagnosed (``ampkit.diagnose.live.doctor``);
3. measures whether the precision is slower than fp32 here (SLOW_LOW_PRECISION), and for fp8 whether
   its GEMM is slower than bf16's (SLOW_FP8_GEMM).

Findings repeated across steps are merged into one per code, module and op by the script doctor's
ledger (``script.ledger``: ``evidence.steps`` lists the steps, ``evidence.occurrences`` counts them).
"""

from __future__ import annotations

from typing import Any

import torch

from ampkit.diagnose.core.display import sort_findings
from ampkit.diagnose.core.perf import fp8_gemm_speed, low_precision_speed
from ampkit.diagnose.script.ledger import Ledger
from ampkit.diagnose.step.api import diagnose_step
from ampkit.diagnose.step.result import DiagnosisResult
from ampkit.env import collect_environment
from ampkit.mixed_precision import MixedPrecision
from ampkit.precision import Precision

__all__ = ["diagnose_task"]


def diagnose_task(task: Any, precision: str | Precision = "auto", *, steps: int = 8, seed: int = 0,
                  device: str | torch.device | None = None, shadow: bool = True, bisect: bool = True,
                  check_speed: bool = True) -> DiagnosisResult:
    """Diagnose ``task`` in ``precision`` (see the module docstring)."""
    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"diagnose_task(steps={steps!r}): must be an int >= 0")
    prec = precision if isinstance(precision, Precision) else Precision.parse(precision, device or "auto")
    dev = prec.device
    model = task.build_model(seed).to(dev)
    optimizer = task.build_optimizer(model)
    mp = MixedPrecision(prec, device=dev, doctor=True)
    model = mp.prepare(model)  # fp8: Float8Linear layers, which the step doctor diagnoses as fp8
    batches = iter(task.batches(seed, dev))
    first = next(batches, None)
    if first is None:
        raise ValueError(f"task {getattr(task, 'name', task)!r} yielded no batch")

    def run(m: torch.nn.Module) -> torch.Tensor:
        with mp.autocast():
            return task.loss(m, first)  # type: ignore[no-any-return]

    scale = float(mp.scale.item()) if mp.scaler.enabled else None  # one host read, before training
    # the first batch is the one step 1 trains on (steps are counted from 1, as the live doctor counts them)
    result = diagnose_step(model, run, precision=prec, loss_scale=scale, step=1, shadow=shadow, bisect=bisect)
    batch = first
    for i in range(steps):
        if i > 0:
            batch = next(batches, None)
            if batch is None:
                break
        with mp.autocast():
            loss = task.loss(model, batch)
        mp.backward(loss)
        mp.step(optimizer)
    findings = list(result.findings)
    assert mp.doctor is not None
    findings.extend(mp.doctor.findings)
    mp.doctor.close()
    if check_speed:
        for slow in (low_precision_speed(prec), fp8_gemm_speed(prec)):
            if slow is not None:
                findings.append(slow)
    ledger = Ledger()
    for f in findings:
        ledger.add(f, key=(f.module, f.op))
    result.findings = sort_findings(ledger.findings())
    result.environment = {**collect_environment(dev), "task": getattr(task, "name", type(task).__name__),
                          "steps": steps, "seed": seed}
    return result
