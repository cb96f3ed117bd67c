"""``preflight_model``: which format each layer of a model can take, known before training starts.

Algorithm:

1. **fp32 pass** over the sample batches (``fp32pass``): each module's range, the gradients' range,
   and every Linear's operands.
2. **One replay per format** (``assess``): the step under the format beside its fp32 shadow, the
   breaks, and for a format that breaks, the smallest policy that removes them, verified by replaying
   with it.  The user's model is never modified: every run is on a copy.

``time_budget`` (seconds) drops batches before it drops a format: after timing the fp32 pass of the
first batch, the batch count shrinks until the estimated replays fit; a format that does not start
within the budget is listed in ``PreflightResult.skipped`` instead of being judged.

>>> import torch
>>> torch.manual_seed(0) and None
>>> model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
>>> batches = [torch.randn(8, 16)]
>>> result = preflight_model(model, batches, loss_fn=lambda m, x: m(x).float().pow(2).mean(), formats="bf16")
>>> [(f.format, f.verdict) for f in result.formats]
[('bf16', 'safe')]
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ampkit._util.digest import state_sha256
from ampkit._util.heartbeat import Heartbeat
from ampkit.diagnose.preflight.assess import assess_format
from ampkit.diagnose.preflight.formats import parse_formats
from ampkit.diagnose.preflight.fp32pass import LossFn, default_loss, fp32_pass
from ampkit.diagnose.preflight.judge import quiet_fp8_warnings
from ampkit.diagnose.preflight.result import PreflightResult
from ampkit.diagnose.preflight.steps import BatchStep, PreflightStep
from ampkit.scaler import DynamicLossScaler

__all__ = ["REPLAY_COST", "preflight_model", "preflight_steps"]

REPLAY_COST = 8.0
"""A format's replay of one batch, in fp32 passes of that batch: the traced step, its fp32 shadow and the
statistics (measured 5-9 on the corpus), before any policy round."""


def preflight_model(model: nn.Module, batches: Iterable[Any], *, loss_fn: LossFn | None = None,
                    formats: str | Sequence[str] | None = None, time_budget: float | None = None,
                    progress: Heartbeat | None = None, environment: bool = False,
                    emulate: bool | None = None) -> PreflightResult:
    """Judge ``formats`` (default: the formats the engine trains; ``"all"`` adds MXFP8 and NVFP4) on ``model``.

    ``batches``: sample batches as the model takes them; ``loss_fn(model, batch)``: the training loss (None:
    the model returns its own, see ``fp32pass.default_loss``).  ``emulate``: compute each format's GEMMs in
    fp32 on its rounded operands (``diagnose.core.gemm_emulation``); None: for the formats this CPU computes
    slowly (fp16 without fp16 units, bf16 and the fp8 recipes without bf16 units); each report's ``gemm``
    says which.  See the module docstring.
    """
    loss = loss_fn or default_loss
    steps = [BatchStep(b, loss) for b in batches]
    if not steps:
        raise ValueError("preflight_model(batches=...): no batch given; pass at least one sample batch")
    return preflight_steps(model, steps, formats=formats, time_budget=time_budget, progress=progress,
                           environment=environment, emulate=emulate)


def preflight_steps(model: nn.Module, steps: Sequence[PreflightStep], *, formats: str | Sequence[str] | None = None,
                    time_budget: float | None = None, progress: Heartbeat | None = None,
                    environment: bool = False, emulate: bool | None = None) -> PreflightResult:
    """``preflight_model`` on steps of any kind (sample batches, or steps captured from a training script)."""
    names = parse_formats(formats)
    samples = list(steps)
    if not samples:
        raise ValueError("preflight: no step to replay; give at least one sample batch")
    if time_budget is not None and not time_budget > 0:
        raise ValueError(f"preflight_model(time_budget={time_budget!r}): give seconds > 0, or None for no limit")
    param = next(model.parameters(), None)
    if param is None:
        raise ValueError("preflight_model(model=...): the model has no parameters, so no format changes it")
    device = param.device
    beat = progress or Heartbeat("ampkit preflight", stream=None, every_s=10.0)
    default_scale = float(DynamicLossScaler().scale_tensor(torch.device("cpu")))  # the default initial scale
    start = time.perf_counter()
    phases: dict[str, float] = {}
    with beat.phase("fp32 pass"), torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
        fp32 = fp32_pass(model, [samples[0].program()], flush_scale=default_scale)
        per_batch = time.perf_counter() - start
        samples = samples[:_batches_within(time_budget, per_batch, len(samples), len(names))]
        if len(samples) > 1:
            fp32_pass(model, [s.program() for s in samples[1:]], flush_scale=default_scale, into=fp32)
    phases["fp32"] = time.perf_counter() - start
    result = PreflightResult(formats=[], inputs=_inputs(model, samples), phases=phases)
    for fmt in names:
        if time_budget is not None and time.perf_counter() - start > time_budget:
            result.skipped.append({"format": fmt, "reason": f"the time budget of {time_budget:g} s was spent"})
            continue
        with beat.phase(f"replaying in {fmt}"), quiet_fp8_warnings(), \
                torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
            report = assess_format(model, samples, fmt, fp32, device=device, default_scale=default_scale,
                                   emulate=emulate)
        result.formats.append(report)
        phases[fmt] = report.seconds
    if environment:
        from ampkit.env import collect_environment

        result.environment = collect_environment(device)
    return result


def _batches_within(budget: float | None, per_batch: float, available: int, formats: int) -> int:
    """How many batches the budget holds: each costs one fp32 pass and ``REPLAY_COST`` per format (at least one)."""
    if budget is None:
        return available
    each = per_batch * (1 + REPLAY_COST * formats)
    return max(1, min(available, int(budget // max(each, 1e-9))))


def _inputs(model: nn.Module, steps: list[PreflightStep]) -> dict[str, Any]:
    return {"batches": len(steps), "shapes": [s.shapes() for s in steps], "weights_sha256": state_sha256(model)}
