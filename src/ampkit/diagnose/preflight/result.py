"""What ``preflight_model`` returns: a verdict per format, with the evidence behind it, per layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ampkit.precision import FormatName

__all__ = ["Break", "BreakKind", "FormatReport", "GemmPath", "LayerReport", "Policy", "PreflightResult", "Verdict"]

Verdict = Literal["safe", "policy", "unsafe"]
"""``safe``: the format runs the model as it is; ``policy``: it does with the verified policy; ``unsafe``: no policy
within the size limit fixes it."""


GemmPath = Literal["native", "emulated"]
"""How a replay computed the format's GEMMs: ``native``, with the device's own kernels, or ``emulated`` in fp32 on
the low-precision operands, rounded to the format (``diagnose.core.gemm_emulation``), where the CPU computes them
slowly."""

BreakKind = Literal["error", "loss_scale", "flush", "sqnr", "gradient"]
"""``error``: the doctor found an error (a non-finite value, an op that raised, gradients flushed); ``loss_scale``:
fp16's default initial scale overflowed the backward (ordinary scaling, but the first steps would be skipped);
``flush``: an operand flushed to zero beyond FP8_FLUSH's threshold; ``sqnr``: the model's output below the
format's SQNR threshold; ``gradient``: most of the gradient below it."""


@dataclass(frozen=True, kw_only=True)
class Break:
    """Where a format first breaks the model: a non-finite value, or the first drop below the format's threshold."""

    kind: BreakKind
    module: str | None
    op: str | None
    location: str | None
    """``file:line`` of the op, or of the module's ``forward`` when the break is a module's SQNR or flush."""
    reason: str


@dataclass(frozen=True, kw_only=True)
class Policy:
    """The engine options that keep layers out of the format (only one of the two lists applies to a format)."""

    keep_fp32: list[str] = field(default_factory=list)
    fp8_filter: list[str] = field(default_factory=list)
    init_scale: float | None = None
    """fp16 only: the initial loss scale to use instead of the scaler's default, when the default overflows or
    flushes this model's gradients."""

    def layers(self) -> list[str]:
        return [*self.keep_fp32, *self.fp8_filter]


@dataclass(kw_only=True)
class LayerReport:
    """One module under one format: its fp32 range and what the format did to it."""

    module: str
    type: str
    absmax: float | None = None
    """Largest |x| of the module's forward output in the fp32 pass (over every batch)."""
    headroom_bits: float | None = None
    """log2(format's largest value / absmax): < 0 overflows; None for a scaled format (fp8, MX, NVFP4),
    whose scale follows the data."""
    below_normal_share: float | None = None
    """Share of the output's non-zero values below the format's smallest normal (subnormal or flushed);
    None for a scaled format."""
    forward_sqnr_db: float | None = None
    grad_sqnr_db: float | None = None
    operands: dict[str, dict[str, float]] = field(default_factory=dict)
    """Quantized layers: per operand (input, weight, grad_output), Transformer Engine's debug statistics
    (``underflows%``, ``overflows%``, ``mse``, ``scale_inv_min``, ``scale_inv_max``, ``dynamic_range``)."""
    eligible: bool = True
    """False: a Linear the format cannot take (a dimension the block size does not divide); ``reason`` says why."""
    reason: str | None = None
    broken: bool = False


@dataclass(kw_only=True)
class FormatReport:
    """One format's verdict, the policy that makes it safe, and the evidence."""

    format: FormatName
    verdict: Verdict
    emulated: bool
    gemm: GemmPath = "native"
    """How the replays computed the format's GEMMs (``preflight_model(emulate=...)``)."""
    first_break: Break | None = None
    policy: Policy = field(default_factory=Policy)
    policy_sqnr_db: dict[str, float | None] = field(default_factory=dict)
    """``{"before": ..., "after": ...}``: the lowest module forward-output SQNR without and with the policy."""
    grad_sqnr_db: float | None = None
    """The SQNR (dB) of all parameter gradients together against fp32, the lowest over the steps, without a policy."""
    layers: list[LayerReport] = field(default_factory=list)
    findings: list[dict[str, Any]] = field(default_factory=list)
    """The doctor's findings of the replay that broke (``ampkit.doctor/1`` records), for the full story."""
    recommended_init_scale: float | None = None
    """fp16: the largest power-of-two loss scale whose scaled gradients stay below fp16's largest value
    with one bit to spare."""
    grad_underflow_at_init_scale: float | None = None
    """fp16: the share of the model's non-zero gradient values that flush to zero at the scaler's default
    initial scale."""
    seconds: float = 0.0


@dataclass(kw_only=True)
class PreflightResult:
    """Every requested format's report, with what the verdicts were computed from."""

    formats: list[FormatReport]
    inputs: dict[str, Any]
    """``batches`` (count), ``shapes`` (per batch), ``weights_sha256``."""
    environment: dict[str, Any] | None = None
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per phase (``fp32``, and one per format)."""
    skipped: list[dict[str, str]] = field(default_factory=list)
    """Formats not judged (``{"format", "reason"}``): the time budget ran out before they started."""

    @property
    def ok(self) -> bool:
        """No requested format is unsafe (exit status 0)."""
        return all(f.verdict != "unsafe" for f in self.formats)

    def report(self, name: FormatName) -> FormatReport:
        return next(f for f in self.formats if f.format == name)
