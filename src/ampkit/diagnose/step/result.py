"""``DiagnosisResult``: what one op-level diagnosis found (``report.json.doctor_document`` writes it as ``ampkit.doctor/1``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ampkit.findings import Finding
from ampkit.precision import PrecisionName

__all__ = ["DiagnosisResult", "Headroom"]

Headroom = dict[str, dict[str, tuple[float, float]]]


@dataclass
class DiagnosisResult:
    """What ``diagnose_step`` found; ``report.json.doctor_document(result)`` is its ``ampkit.doctor/1`` document."""

    findings: list[Finding]
    """Sorted worst first."""
    module_headroom: Headroom = field(default_factory=dict)
    """Module -> format -> (bits to overflow, bits to underflow) in the forward: overflow against the
    largest magnitude computed anywhere inside the module (every op's output, sub-modules
    included: an intermediate like x*x overflows even when the module's output is small);
    underflow against the smallest non-zero magnitude of its outputs.  Measured on the fp32
    reference when there is one (true values, not values already clipped to inf), else on the
    low-precision run."""
    grad_headroom: Headroom = field(default_factory=dict)
    """The same for the backward (unscaled): overflow against the largest gradient computed in the
    module's backward ops, underflow against its parameters' smallest non-zero gradient."""
    keep_fp32: list[str] | None = None
    """The verified minimal set of modules to keep in fp32 (None when none was needed or found)."""
    fp8_filter: list[str] | None = None
    """For a model with fp8 layers: the verified minimal ``fp8_filter`` (modules kept out of fp8), or None."""
    precision: PrecisionName | Literal[""] = ""
    """The precision the step was replayed under; empty for a result that holds findings only."""
    step: int | None = None
    loss: float | None = None
    loss_fp32: float | None = None
    comparison: dict[str, Any] = field(default_factory=dict)
    """Per-module output/gradient SQNR (dB) and gradient underflow fractions."""
    bisection: dict[str, Any] | None = None
    environment: dict[str, Any] | None = None

    @property
    def has_errors(self) -> bool:
        return any(f.severity == "error" for f in self.findings)
