"""Setup checks: a framework's training setup, checked before its first step.

A framework decides the precision from its own settings and the machine, and can quietly run
something other than what was asked for (``TrainingArguments(fp16=True)`` on a CPU trains in
fp32; Lightning's ``"16-mixed"`` on a CPU autocasts to bf16).  Every integration calls
``setup_checks(...)`` once, with what was requested and what is in effect, and gets
``ampkit.findings.Finding``s back:

* ``MIXED_PRECISION_OFF``: the precision in effect is not the one requested;
* ``LOW_PRECISION_PARAMS``: trainable parameters stored in bf16/fp16 (transformers v5 keeps a
  checkpoint's dtype when loading, so a bf16 checkpoint trains bf16 weights unless told otherwise);
* ``SCALER_WITH_BF16``: an enabled ``GradScaler`` with bf16 autocast;
* ``SCHEDULER_STEPPED_ON_SKIP`` (info): fp16 with a fused optimizer, whose skipped steps a
  framework that watches ``optimizer.step()`` calls cannot see (accelerate#4242).

Nothing here reads a tensor's values: dtypes, flags and class names only.

>>> import torch
>>> model = torch.nn.Linear(4, 2).to(torch.bfloat16)
>>> [f.code for f in setup_checks(requested="bf16", actual="bf16", model=model, framework="Trainer")]
['LOW_PRECISION_PARAMS']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ampkit._util.dtypes import dtype_name
from ampkit.findings import (
    BF16_NEEDS_NO_SCALER,
    LOW_PRECISION_UPDATES_LOST,
    Finding,
    autocast_setting,
    mixed_precision_off,
)
from ampkit.precision import LOW_PRECISION_DTYPES, PrecisionName

__all__ = ["PrecisionInEffect", "setup_checks"]


class PrecisionInEffect:
    """What a framework was asked to run and what it runs.

    Args:
        requested: ``"fp16"``, ``"bf16"`` or None (nothing asked), as the framework's setting spells it
            in ``setting`` (``"TrainingArguments(fp16=True)"``).
        actual: ``"fp16"``, ``"bf16"`` or ``"fp32"``: the autocast dtype in effect (fp32: none).
        reason: why ``actual`` differs, when it does (the framework's own rule, the machine).
        turn_on: how to get the requested precision with what the code already has.
    """

    def __init__(self, requested: PrecisionName | None, actual: PrecisionName, *, setting: str = "", reason: str = "",
                 turn_on: str = "") -> None:
        self.requested, self.actual = requested, actual
        self.setting = setting or f"precision {requested}"
        self.reason = reason or f"the framework runs {actual} where {requested} was requested"
        self.turn_on = turn_on or f"run on a device where the framework enables {requested} autocast"

    def __repr__(self) -> str:
        return f"PrecisionInEffect(requested={self.requested!r}, actual={self.actual!r})"


def setup_checks(*, requested: PrecisionName | None = None, actual: PrecisionName = "fp32", precision: PrecisionInEffect | None = None,
                 model: nn.Module | None = None, optimizers: Sequence[torch.optim.Optimizer] = (), scaler: Any = None,
                 framework: str = "the framework") -> list[Finding]:
    """The setup-check findings of one training setup (see the module docstring).

    ``precision`` (a ``PrecisionInEffect``) carries the texts of MIXED_PRECISION_OFF; ``requested`` /
    ``actual`` are its short form.  ``model`` and ``optimizers`` give the trainable parameters.
    """
    precision = precision or PrecisionInEffect(requested, actual)
    found: list[Finding] = []
    if precision.requested not in (None, "fp32") and precision.actual != precision.requested:
        message, fix = mixed_precision_off(precision.setting, f"{framework} trains in {precision.actual}",
                                           precision.reason, precision.turn_on)
        found.append(Finding(code="MIXED_PRECISION_OFF", severity="warning", message=message, fix=fix,
                             evidence={"requested": precision.requested, "actual": precision.actual,
                                       "framework": framework}))
    found.extend(_low_params(model, optimizers, framework))
    enabled = scaler is not None and bool(getattr(scaler, "is_enabled", lambda: False)())
    if enabled and precision.actual == "bf16":
        found.append(Finding(
            code="SCALER_WITH_BF16", severity="warning",
            message=f"{framework} scales the loss with a GradScaler while autocast runs bf16: {BF16_NEEDS_NO_SCALER}",
            fix="drop the GradScaler for bf16, or create it with enabled=(dtype == torch.float16)",
            evidence={"actual": "bf16"}))
    fused = [type(o).__name__ for o in optimizers if _is_fused(o)]
    if enabled and precision.actual == "fp16" and fused:
        found.append(Finding(
            code="SCHEDULER_STEPPED_ON_SKIP", severity="info",
            message=(f"fp16 with a fused optimizer ({', '.join(fused)}): GradScaler calls a fused optimizer even on "
                     "a step it skips, so a framework that detects skips by watching optimizer.step() (Accelerate's "
                     "step_was_skipped, accelerate#4242) never sees one and steps the LR scheduler on it. ampkit "
                     "reads the skip from the scaler's found_inf itself and reports SCHEDULER_STEPPED_ON_SKIP if "
                     "the schedule advances on a skipped step"),
            fix=("nothing to change unless SCHEDULER_STEPPED_ON_SKIP fires; then step the scheduler only when the "
                 "scale did not back off, or use a non-fused optimizer (fused=False)"),
            evidence={"optimizers": fused}))
    return found


def _is_fused(optimizer: torch.optim.Optimizer) -> bool:
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) or any(
        bool(g.get("fused")) for g in optimizer.param_groups)


def _low_params(model: nn.Module | None, optimizers: Sequence[torch.optim.Optimizer], framework: str) -> list[Finding]:
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    params = [p for o in optimizers for g in o.param_groups for p in g["params"]] or (
        list(model.parameters()) if model is not None else [])
    trainable = {id(p): p for p in params if p.requires_grad}
    low = [p for p in trainable.values() if p.dtype in LOW_PRECISION_DTYPES]
    if not low:
        return []
    dtypes = sorted({dtype_name(p.dtype) for p in low})
    shown = [names.get(id(p), f"<{tuple(p.shape)}>") for p in low[:5]]
    return [Finding(
        code="LOW_PRECISION_PARAMS", severity="error",
        message=(f"{len(low)} of {len(trainable)} trainable parameters are stored in {'/'.join(dtypes)} before "
                 f"{framework}'s first step ({', '.join(shown)}{', ...' if len(low) > 5 else ''}): "
                 f"{LOW_PRECISION_UPDATES_LOST}; a model loaded from a bf16/fp16 checkpoint keeps that dtype (transformers v5 "
                 "keeps the checkpoint's dtype by default)"),
        fix=("load the weights in fp32 (from_pretrained(..., dtype=torch.float32), or model.float()) and let "
             f"mixed precision ({autocast_setting(framework)}) cast them per op"),
        evidence={"low_precision_params": len(low), "params": len(trainable), "dtypes": dtypes, "examples": shown},
    )]
