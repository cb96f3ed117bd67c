"""Findings: the doctor's unit of output, with the stable code catalog (see docs/findings.md)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = ["CODES", "SEVERITY_ORDER", "Finding", "Severity"]

Severity = Literal["error", "warning", "info"]

SEVERITY_ORDER: dict[str, int] = {"error": 0, "warning": 1, "info": 2}

# Stable codes (DESIGN.md) and the severity each one has unless evidence says otherwise.
CODES: dict[str, Severity] = {
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
    "CHECKPOINT_MISSING_SCALER": "error",
    "STALE_WEIGHT_CACHE": "error",
    "AUTOCAST_INACTIVE": "warning",
    "SLOW_LOW_PRECISION": "warning",
    "NORM_STATS_NONFINITE": "error",
    "PRECISION_LOSS": "warning",
}


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One diagnosed problem, serialised as an entry of ``ampkit.doctor/1``'s ``findings``."""

    code: str
    """A key of ``CODES``."""
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
