"""The live doctor's own findings: a non-finite gradient seed, a classified scale collapse, and the
folding of a failure's consequences into the finding of its cause."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ampkit._util.dtypes import dtype_name
from ampkit.diagnose.core.display import display_module
from ampkit.findings import SCALE_COLLAPSE_CAUSES, Finding, loss_in_low_precision_finding
from ampkit.precision import LOW_PRECISION_DTYPES

__all__ = ["fold_consequence", "fold_parameters", "loss_finding", "scale_collapse_finding", "seed_finding",
           "weights_nonfinite"]

MAX_LISTED = 32
"""Steps listed in ``evidence.consequence_steps`` (later ones are counted in ``consequences`` only), and
parameter names in ``evidence.parameters`` (all are counted in ``count``)."""


def seed_finding(losses: list[torch.Tensor], model: nn.Module, step: int, scale: float) -> Finding:
    """The model's forward is finite but the gradient reaching its outputs is not."""
    # One dtype, as the other doctors report the loss's (in name order: bf16, fp16, fp32, so a narrow one first).
    dtype = min((dtype_name(x.dtype) for x in losses), default=None)
    losses_finite = all(bool(torch.isfinite(x).all()) for x in losses)
    if losses_finite and scale > 1.0:
        return Finding(
            code="BACKWARD_OVERFLOW", severity="info",
            message=(f"the gradient reaching the model's outputs overflowed at loss scale {scale:g} while the loss "
                     "itself is finite: ordinary dynamic loss scaling — the step is skipped and the scale backs off"
                     + (f"; the loss is {dtype}, so its gradient is narrow from the start" if dtype in ("fp16", "bf16")
                        else "")),
            fix=("Nothing to change if it happens now and then; if most steps are skipped, lower init_scale. "
                 "Computing the loss in fp32 (loss_fn(output.float(), target)) widens the range at this boundary."),
            step=step, evidence={"loss_scale": scale, "loss_dtype": dtype, "phase": "backward",
                                 "where": "model output"},
        )
    return Finding(
        code="FORWARD_NAN", severity="error",
        message=("the model's forward is finite, but the gradient reaching its outputs is not: the non-finite "
                 "value was produced between the model output and the loss (the loss function or the targets)"
                 + (f"; the loss was {dtype}" if dtype else "")),
        fix=("Check the targets for NaN/inf, clamp probabilities before log(), and compute the loss in fp32 "
             "(loss_fn(output.float(), target))."),
        step=step, evidence={"loss_dtype": dtype, "model": type(model).__name__},
    )


def loss_finding(losses: list[torch.Tensor], step: int, scale: float | None) -> Finding | None:
    """LOSS_IN_LOW_PRECISION when a captured loss is bf16 or fp16 (the narrowest one named), else None."""
    low = sorted(dtype_name(x.dtype) for x in losses if x.dtype in LOW_PRECISION_DTYPES)
    return loss_in_low_precision_finding(low[0], scale=scale, step=step) if low else None


def scale_collapse_finding(found: list[Finding], step: int, scale: float) -> Finding:
    """SCALE_COLLAPSE with its cause classified from what the replay of the last step found."""
    codes = {f.code for f in found if f.severity == "error"}
    infos = {f.code for f in found if f.severity == "info"}
    if "NONFINITE_INPUT" in codes:
        cause, detail = "nonfinite_data_or_loss", "non-finite values in the data (NONFINITE_INPUT)"
    elif codes & {"FORWARD_OVERFLOW", "FORWARD_NAN", "CAST_OVERFLOW", "NORM_STATS_NONFINITE", "DTYPE_MISMATCH"}:
        cause, detail = "nonfinite_data_or_loss", f"a non-finite forward/loss ({', '.join(sorted(codes))})"
    elif any(f.code == "BACKWARD_OVERFLOW" and "singularity" in f.evidence for f in found):
        cause, detail = "gradient_singularity", ("a derivative singularity in backward that overflows at any scale "
                                                 "(BACKWARD_OVERFLOW)")
    elif "BACKWARD_OVERFLOW" in codes:
        cause, detail = "gradient_overflow", "gradients that overflow even at scale 1 (BACKWARD_OVERFLOW)"
    elif "BACKWARD_OVERFLOW" in infos:
        cause, detail = "gradient_overflow", "real gradient overflow at the current scale, avoidable by a lower scale"
    else:
        cause, detail = "not_reproduced", SCALE_COLLAPSE_CAUSES["not_reproduced"].what
    top = next((f for f in found if f.severity == "error"), None)
    return Finding(
        code="SCALE_COLLAPSE", severity="error",
        message=f"the loss scale collapsed; replaying step {step} attributes it to {detail}"
                + (f" in {display_module(top.module)}" if top is not None and top.module is not None else ""),
        fix=top.fix if top is not None else SCALE_COLLAPSE_CAUSES["not_reproduced"].fix,
        module=top.module if top is not None else None, op=top.op if top is not None else None,
        location=top.location if top is not None else None, step=step,
        evidence={"cause": cause, "scale": scale},
    )


def weights_nonfinite(models: list[nn.Module]) -> bool:
    """Whether any parameter of ``models`` holds inf/NaN (one host read; the failure path only)."""
    params = [p for m in models for p in m.parameters()]
    return bool(params) and not bool(torch.stack([torch.isfinite(p).all() for p in params]).all())


def fold_consequence(findings: list[Finding], origin: Finding, step: int) -> Finding:
    """Record failing step ``step`` as a consequence of ``origin`` (replaced in ``findings``); returns the new one.

    A step that fails on weights an earlier failure already made non-finite shows nothing new: its
    replay would report every parameter again.
    """
    steps = list(origin.evidence.get("consequence_steps", []))
    if len(steps) < MAX_LISTED:
        steps.append(step)
    count = int(origin.evidence.get("consequences", 0)) + 1
    folded = replace(origin, evidence={**origin.evidence, "consequence_steps": steps, "consequences": count})
    for i, f in enumerate(findings):
        if f is origin:
            findings[i] = folded
    return folded


def fold_parameters(found: list[Finding], step: int, *, after_update: bool) -> list[Finding]:
    """The replay's NONFINITE_INPUT findings of non-finite parameters folded into one (one cause, one finding).

    ``after_update``: the replay ran on the weights after step ``step``'s own update (decided after the
    optimizer step, as on an accelerator), so that update, not an earlier step, wrote the inf/NaN.
    """
    params = [f for f in found if f.code == "NONFINITE_INPUT" and f.evidence.get("kind") in ("parameter", "buffer")]
    if not params:
        return found
    names = sorted(str(f.evidence.get("name")) for f in params)
    shown = ", ".join(repr(n) for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    if after_update:
        message = (f"{len(names)} parameter(s) ({shown}) are non-finite in the replay of step {step}: it ran on the "
                   "weights after that step's update, which applied the step's non-finite gradients (the doctor "
                   "learns of a failure on an accelerator after the optimizer step, never waiting for the device), "
                   "so the replay cannot show where the inf/NaN arose")
        fix = ("Skip such steps instead of applying them: keep skip_nonfinite=True (the default of MixedPrecision) "
               "or use a GradScaler; to see where the inf/NaN arose, run `ampkit doctor train.py`, or the step on "
               "the CPU, where the live doctor replays a failing step before its update.")
    else:
        message = (f"{len(names)} parameter(s) ({shown}) are already non-finite before step {step}: an earlier "
                   "step wrote inf/NaN into them")
        fix = params[0].fix
    first = params[0]
    evidence = {**first.evidence, "parameters": names[:MAX_LISTED], "count": len(names),
                "weights": "after_update" if after_update else "before_step"}
    evidence.pop("name", None)
    ids = {id(f) for f in params}
    return [replace(first, message=message, fix=fix, evidence=evidence), *[f for f in found if id(f) not in ids]]
