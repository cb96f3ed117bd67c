"""Findings: the doctor's unit of output, the stable codes, and the catalog of their texts.

Every emitter of a finding (telemetry alarms, the step, script and live doctors) builds the
message and the fix of a code that several of them report from the functions here, so the
same problem reads the same wherever it is found (see docs/findings.md for the meaning of
each code).

>>> message, fix = scale_collapse("gradient_overflow", "3 consecutive backoffs", " (steps 4-6)")
>>> message
'3 consecutive backoffs. Cause: the loss was finite but the gradients overflowed: a real gradient overflow in low precision (steps 4-6)'
>>> nonfinite_input("input #0 holds NaN at step 2")[0]
'input #0 holds NaN at step 2: the data, not the precision, is the cause'
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ampkit._util.dtypes import dtype_name

__all__ = [
    "BF16_NEEDS_NO_SCALER",
    "CODES",
    "LOW_PRECISION_UPDATES_LOST",
    "NONFINITE_DATA_FIX",
    "SCALE_COLLAPSE_CAUSES",
    "SEVERITY_ORDER",
    "Cause",
    "Code",
    "Finding",
    "Severity",
    "accelerate_fp16_off",
    "autocast_setting",
    "loss_in_low_precision",
    "loss_in_low_precision_finding",
    "mixed_precision_off",
    "nonfinite_input",
    "scale_collapse",
    "scheduler_stepped_on_skip",
]

Severity = Literal["error", "warning", "info"]

SEVERITY_ORDER: dict[str, int] = {"error": 0, "warning": 1, "info": 2}

Code = Literal[
    "FORWARD_OVERFLOW",
    "FORWARD_NAN",
    "CAST_OVERFLOW",
    "DTYPE_MISMATCH",
    "BACKWARD_OVERFLOW",
    "GRADIENT_UNDERFLOW",
    "NONFINITE_INPUT",
    "SCALE_COLLAPSE",
    "LOSS_IN_LOW_PRECISION",
    "NO_LOSS_SCALING",
    "SCALER_WITH_BF16",
    "LOW_PRECISION_PARAMS",
    "CLIP_BEFORE_UNSCALE",
    "UNSCALE_ORDER_ERROR",
    "ACCUMULATION_SCALE_CHANGE",
    "SCHEDULER_STEPPED_ON_SKIP",
    "CHECKPOINT_MISSING_SCALER",
    "STALE_WEIGHT_CACHE",
    "AUTOCAST_INACTIVE",
    "SLOW_LOW_PRECISION",
    "NORM_STATS_NONFINITE",
    "PRECISION_LOSS",
    "MIXED_PRECISION_OFF",
    "COMPILED_DIVERGENCE",
    "FP8_FLUSH",
    "SLOW_FP8_GEMM",
    "FORKED_CHILD_UNOBSERVED",
    "GRADIENT_PENALTY_SCALED",
]
"""The stable finding codes (docs/findings.md): a misspelled code fails the type check, not a user's run."""

# The severity each code has unless evidence says otherwise.
CODES: dict[Code, Severity] = {
    "FORWARD_OVERFLOW": "error",
    "FORWARD_NAN": "error",
    "CAST_OVERFLOW": "error",
    "DTYPE_MISMATCH": "error",
    "BACKWARD_OVERFLOW": "error",
    "GRADIENT_UNDERFLOW": "warning",
    "NONFINITE_INPUT": "error",
    "SCALE_COLLAPSE": "error",
    "LOSS_IN_LOW_PRECISION": "warning",
    "NO_LOSS_SCALING": "error",
    "SCALER_WITH_BF16": "warning",
    "LOW_PRECISION_PARAMS": "error",
    "CLIP_BEFORE_UNSCALE": "error",
    "UNSCALE_ORDER_ERROR": "error",
    "ACCUMULATION_SCALE_CHANGE": "error",
    "SCHEDULER_STEPPED_ON_SKIP": "warning",
    "CHECKPOINT_MISSING_SCALER": "warning",
    "STALE_WEIGHT_CACHE": "error",
    "AUTOCAST_INACTIVE": "warning",
    "SLOW_LOW_PRECISION": "warning",
    "NORM_STATS_NONFINITE": "error",
    "PRECISION_LOSS": "warning",
    "MIXED_PRECISION_OFF": "warning",
    "COMPILED_DIVERGENCE": "warning",
    "FP8_FLUSH": "warning",
    "SLOW_FP8_GEMM": "warning",
    "FORKED_CHILD_UNOBSERVED": "info",
    "GRADIENT_PENALTY_SCALED": "error",
}


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One diagnosed problem, serialised as an entry of ``ampkit.doctor/1``'s ``findings``."""

    code: Code
    """One of the stable codes (``Code``, the keys of ``CODES``)."""
    severity: Severity
    """``error`` (exit 1), ``warning`` or ``info``."""
    message: str
    """What happened, with the numbers that show it."""
    fix: str
    """What to change, concretely (ready-to-paste where possible)."""
    module: str | None = None
    """Dotted module name (``model.named_modules()``) of the producer, or None."""
    op: str | None = None
    """The aten op (``aten::mm``), or None."""
    location: str | None = None
    """User source ``file:line``, or None."""
    step: int | None = None
    """Training step, or None."""
    evidence: dict[str, Any] = field(default_factory=dict)
    """JSON-serialisable measurements behind the finding."""

    def __post_init__(self) -> None:
        if self.code not in CODES:
            raise ValueError(f"unknown finding code {self.code!r}; known: {sorted(CODES)}")
        if self.severity not in SEVERITY_ORDER:
            raise ValueError(f"severity {self.severity!r} must be one of {list(SEVERITY_ORDER)}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- the catalog: message and fix per code, built from what the emitter measured ------------------
NONFINITE_DATA_FIX = (
    "drop or repair the non-finite samples at the source (torch.nan_to_num, or keep the rows where "
    "torch.isfinite(x).all(dim=1)), and check torch.isfinite(batch).all() in the data pipeline"
)
"""The fix of non-finite data (NONFINITE_INPUT, and SCALE_COLLAPSE caused by it)."""

LOW_PRECISION_UPDATES_LOST = (
    "updates smaller than the weight's rounding step (2^-11 relative in fp16, 2^-8 in bf16) are lost, "
    "so training stalls or drifts"
)
"""Why trainable parameters stored in fp16/bf16 are a problem (LOW_PRECISION_PARAMS)."""

BF16_NEEDS_NO_SCALER = (
    "bf16 has fp32's exponent range, so gradients do not underflow and scaling only adds work (and "
    "skipped steps when the scale overshoots)"
)
"""Why a GradScaler is not wanted with bf16 (SCALER_WITH_BF16)."""


def nonfinite_input(where: str) -> tuple[str, str]:
    """NONFINITE_INPUT's message and fix; ``where`` names the tensor, its NaN/inf and the step."""
    return f"{where}: the data, not the precision, is the cause", NONFINITE_DATA_FIX


@dataclass(frozen=True)
class Cause:
    """One cause of a finding: what happened (a sentence fragment) and the fix."""

    what: str
    fix: str


_DATA = Cause("the input batch itself held NaN/inf, so every such step overflows whatever the scale "
              "(bad data, not fp16 range)", NONFINITE_DATA_FIX + "; no loss scale makes NaN inputs finite")
_FORWARD_FIX = ("find the op with FORWARD_OVERFLOW / FORWARD_NAN (`ampkit doctor`, or MixedPrecision(..., "
                "doctor=True)) and keep that module in fp32 (keep_fp32=[...]), or compute the loss in fp32; "
                "lowering the loss scale cannot help a forward overflow")

SCALE_COLLAPSE_CAUSES: dict[str, Cause] = {
    "nonfinite_data": _DATA,
    "nonfinite_input": _DATA,
    "nonfinite_loss": Cause(
        "the loss was already non-finite in the forward pass (an activation overflowed or went NaN)", _FORWARD_FIX),
    "nonfinite_forward": Cause(
        "activations went inf/NaN in the forward pass although the loss stayed finite (the non-finite "
        "values were masked out of the loss but not out of the backward)", _FORWARD_FIX),
    "scaled_loss_overflow": Cause(
        "the loss was finite but loss × scale overflowed because the loss is fp16",
        "compute the loss in fp32 (LOSS_IN_LOW_PRECISION)"),
    "gradient_overflow": Cause(
        "the loss was finite but the gradients overflowed: a real gradient overflow in low precision",
        "find the module with BACKWARD_OVERFLOW (`ampkit doctor`, or MixedPrecision(..., doctor=True)) and keep "
        "it in fp32 (keep_fp32=[...]), reduce the loss's magnitude (mean instead of sum, normalised targets), "
        "or train in bf16"),
    "gradient_singularity": Cause(
        "the loss was finite but the backward hit a derivative singularity (sqrt, pow, norm, acos or atan2 "
        "evaluated where its derivative is infinite, because a small quantity underflowed to 0 in low "
        "precision): the gradients are inf/NaN at any scale, so the scaler backs off without end",
        "find the module with BACKWARD_OVERFLOW (`ampkit doctor`, or MixedPrecision(..., doctor=True)) and keep "
        "that computation in fp32 (keep_fp32=[...], or torch.autocast(..., enabled=False) and .float()), with the "
        "epsilon inside the sqrt; raising or lowering the loss scale cannot help"),
    "not_reproduced": Cause(
        "the last step replays finite; the collapse came from earlier steps",
        "Inspect the steps before the collapse (telemetry's scale history); a scale that keeps halving with a "
        "finite loss means gradients overflow every step: keep the overflowing module in fp32 or use bf16."),
}
"""SCALE_COLLAPSE by cause (the finding's ``evidence["cause"]``)."""


def scale_collapse(cause: str, context: str, detail: str = "") -> tuple[str, str]:
    """SCALE_COLLAPSE's message and fix: ``context`` says what collapsed, ``detail`` follows the cause."""
    known = SCALE_COLLAPSE_CAUSES[cause]
    return f"{context}. Cause: {known.what}{detail}", known.fix


def scheduler_stepped_on_skip(count: int, first: int) -> tuple[str, str]:
    """SCHEDULER_STEPPED_ON_SKIP's message and fix: ``count`` skipped steps the scheduler advanced on, from ``first``.

    >>> scheduler_stepped_on_skip(2, 5)[0][:62]
    'the LR scheduler stepped after 2 optimizer steps that the Grad'
    """
    message = (f"the LR scheduler stepped after {count} optimizer steps that the GradScaler skipped "
               f"(first at step {first}): the schedule ran {count} steps ahead of the parameter updates "
               "(warm-up shortened, decay started early)")
    fix = ("step the scheduler only when the optimizer stepped: `scale = scaler.get_scale(); scaler.update(); "
           "if scaler.get_scale() >= scale: scheduler.step()` (or ampkit's mp.scheduler_step(scheduler, result))")
    return message, fix


def mixed_precision_off(requested: str, actual: str, reason: str, turn_on: str, *,
                        dtype: str | None = None) -> tuple[str, str]:
    """MIXED_PRECISION_OFF's message and fix: mixed precision the code asked for is not in effect.

    ``requested`` names what asked for it (the object and where it was built, or a framework's
    setting), ``actual`` what ran instead, ``reason`` why it is off, and ``turn_on`` how to turn
    on what the code already has (not how to add something new).  ``dtype`` (``fp16``/``bf16``)
    names the precision asked for, when another one ran instead (then the fix does not offer fp32).

    >>> message, fix = mixed_precision_off(
    ...     "TrainingArguments(fp16=True)", "the model trained in fp32",
    ...     "fp16 mixed precision needs a CUDA device and this machine has none",
    ...     "pass bf16=True instead of fp16=True on CPU (no loss scaling needed)")
    >>> message
    'TrainingArguments(fp16=True) asks for mixed precision, but it is not in effect: fp16 mixed precision needs a CUDA device and this machine has none. What ran: the model trained in fp32'
    >>> fix.startswith("pass bf16=True") and fix.endswith("training in fp32 is intended")
    True
    """
    asked = f"{dtype} mixed precision" if dtype else "mixed precision"
    message = f"{requested} asks for {asked}, but it is not in effect: {reason}. What ran: {actual}"
    fix = turn_on if dtype else f"{turn_on}; or remove the request if training in fp32 is intended"
    return message, fix


def accelerate_fp16_off(device: str, bf16: str = "bf16=True / mixed_precision='bf16'") -> tuple[str, str]:
    """Why fp16 asked of Accelerate (``TrainingArguments(fp16=True)``, ``mixed_precision='fp16'``) trains in
    fp32 on ``device`` without an accelerator, and how to turn mixed precision on: MIXED_PRECISION_OFF's
    ``reason`` and ``turn_on``, for the integrations and for ``ampkit doctor SCRIPT``.  ``bf16``: the setting
    that asks for bf16 where the request was made.

    >>> accelerate_fp16_off("cpu", "Accelerator(mixed_precision='bf16')")[1]
    "run on a GPU, or ask for bf16 instead (Accelerator(mixed_precision='bf16')), which runs on CPU"
    """
    # Accelerate 1.x and transformers 5.x say nothing at all (not even at debug verbosity).
    return (f"Accelerate enables fp16 autocast and its GradScaler only on an accelerator (CUDA, XPU, ...) and this "
            f"run is on {device}, so it trains in fp32 without a warning or a log line saying so",
            f"run on a GPU, or ask for bf16 instead ({bf16}), which runs on CPU")


def autocast_setting(framework: str | None) -> str:
    """The setting that turns autocast on in ``framework`` (``Trainer``: Hugging Face's, ``Lightning``,
    ``Accelerate``; None: a plain loop), for the fixes that tell the user to keep fp32 weights and let
    autocast cast per op.

    >>> autocast_setting("Lightning")
    "Trainer(precision='bf16-mixed' / '16-mixed')"
    >>> autocast_setting(None)
    'torch.autocast'
    """
    return {"Trainer": "TrainingArguments(bf16=True / fp16=True)",
            "Lightning": "Trainer(precision='bf16-mixed' / '16-mixed')",
            "Accelerate": "Accelerator(mixed_precision='bf16' / 'fp16')"}.get(framework or "", "torch.autocast")


_SIGNIFICANT_BITS = {"fp16": 11, "bf16": 8}
_LARGEST = {"fp16": 65504.0, "bf16": 3.3895313892515355e38}


def loss_in_low_precision(dtype: Any, *, scale: float | None = None, overflowed: bool = False) -> tuple[str, str]:
    """LOSS_IN_LOW_PRECISION's message and fix, for every emitter.

    ``dtype``: the loss's dtype (``torch.float16`` or its name); ``scale``: the loss scale applied
    to it, when the emitter knows it (None: not known); ``overflowed``: scaling it already
    overflowed (the error form, reported by the script doctor's scaler watcher).

    >>> loss_in_low_precision("float16", scale=1024.0)[0]
    'the loss is a fp16 tensor: its value and its gradient seed are rounded to fp16 (11 significant bits), and scaling it by 1024 keeps it in fp16, where it can overflow'
    >>> loss_in_low_precision("bfloat16", scale=1024.0)[0]
    'the loss is a bf16 tensor: its value and its gradient seed are rounded to bf16 (8 significant bits)'
    >>> loss_in_low_precision("bfloat16")[1]
    'compute the loss in fp32: call .float() on the model output before the loss, e.g. `loss = loss_fn(output.float(), target)`, or compute it outside the autocast block'
    """
    name = dtype_name(dtype)
    message = (f"the loss is a {name} tensor: its value and its gradient seed are rounded to {name} "
               f"({_SIGNIFICANT_BITS.get(name, '?')} significant bits)")
    if overflowed:
        message += (f", and scaling it overflowed {name}: backward starts from d(loss × scale)/d(loss) = scale, "
                    f"rounded to {name} (largest {_LARGEST.get(name, math.inf):g}), so every step at a larger scale "
                    "is skipped although the loss itself was finite")
    # Overflow is fp16's risk only: bf16 has fp32's range, and costs rounding alone.
    elif name == "fp16" and scale is None:
        message += f", and under loss scaling loss × scale can overflow {name}"
    elif name == "fp16" and scale != 1.0:
        message += f", and scaling it by {scale:g} keeps it in {name}, where it can overflow"
    fix = ("compute the loss in fp32: call .float() on the model output before the loss, e.g. "
           "`loss = loss_fn(output.float(), target)`, or compute it outside the autocast block"
           + (", so that loss × scale stays finite" if overflowed else ""))
    return message, fix


def loss_in_low_precision_finding(dtype: Any, *, scale: float | None = None, overflowed: bool = False,
                                  location: str | None = None, step: int | None = None) -> Finding:
    """LOSS_IN_LOW_PRECISION as every doctor reports it: ``loss_in_low_precision``'s message and fix, an error
    when scaling the loss ``overflowed`` (else a warning), and the evidence ``loss_dtype`` (as ``dtype_name``
    spells it) and ``loss_scale`` (None where the emitter does not know the scale).

    >>> f = loss_in_low_precision_finding("float16", scale=1024.0, step=3)
    >>> (f.severity, f.evidence)
    ('warning', {'loss_dtype': 'fp16', 'loss_scale': 1024.0})
    """
    message, fix = loss_in_low_precision(dtype, scale=scale, overflowed=overflowed)
    return Finding(code="LOSS_IN_LOW_PRECISION", severity="error" if overflowed else "warning", message=message,
                   fix=fix, location=location, step=step,
                   evidence={"loss_dtype": dtype_name(dtype), "loss_scale": scale})
