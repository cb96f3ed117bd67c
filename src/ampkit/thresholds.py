"""Thresholded verdicts that do not flip with the machine: each rule's threshold and borderline band.

Several findings are decided by comparing one measured number with a threshold: PRECISION_LOSS
(an output's SQNR against fp32), GRADIENT_UNDERFLOW (the share of a module's gradient entries
flushed to zero), SCALE_COLLAPSE of a script's scaler (the share of the run's second half that
was still skipped), SLOW_LOW_PRECISION (the low precision's matmul throughput over fp32's), and for fp8
models PRECISION_LOSS_FP8, FP8_FLUSH (an operand's share flushed to zero) and SLOW_FP8_GEMM.
The number depends on the CPU's kernels (accumulation order, fused or emulated bf16/fp16) and,
for a timing, on what else the machine runs.  A value a hair from the threshold would then be a
warning on one CPU and absent on another, although nothing about the user's code differs.

So every rule has a fixed margin in the metric's own unit (``THRESHOLDS``):

* beyond the threshold by more than the margin: the finding, at its code's severity;
* within the margin on either side: *borderline*, reported at severity ``info`` with the same
  wording on every CPU, and never an error or a warning;
* on the safe side by more than the margin: nothing.

A caller's own threshold (``diagnose_step(sqnr_threshold_db=...)``) keeps the rule's margin.

Each finding of these codes carries ``evidence["judgement"]`` (``Threshold.evidence``): the
measured value, the threshold, the margin and the outcome; a borderline one also has
``evidence["borderline"] = True``.

>>> rule = THRESHOLDS["PRECISION_LOSS"]
>>> [rule.judge(v) for v in (12.0, 19.0, 21.4, 30.0)]
['reported', 'borderline', 'borderline', 'clear']
>>> rule.evidence(19.0)["outcome"], rule.evidence(19.0)["threshold"]
('borderline', 20.0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from ampkit.findings import Code, Finding
from ampkit.precision import FormatName

__all__ = ["FORMAT_FLUSH", "FORMAT_OUTPUT_SQNR", "FORMAT_SQNR", "MODEL_OUTPUT_SQNR", "THRESHOLDS", "Outcome", "RuleName", "Threshold", "as_borderline", "is_borderline"]

Outcome = Literal["reported", "borderline", "clear"]
RuleName = Literal["PRECISION_LOSS", "GRADIENT_UNDERFLOW", "SCALE_COLLAPSE", "SLOW_LOW_PRECISION",
                   "PRECISION_LOSS_FP8", "FP8_FLUSH", "SLOW_FP8_GEMM"]
"""A key of ``THRESHOLDS``: the finding code a rule decides, or, where one code has two rules, the code
and what sets the second apart (``PRECISION_LOSS_FP8``: PRECISION_LOSS of an fp8 model).  A rule name is
never a finding code of its own; ``Threshold.code`` is the code the finding carries."""
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class Threshold:
    """One thresholded rule: the metric, the threshold, the side that reports, and the borderline band."""

    code: Code
    """The finding code the rule decides (several rules may decide one code)."""
    metric: str
    """What is measured, as named in the evidence (``sqnr_db``, ``flushed_share``, ...)."""
    threshold: float
    """The value at which the rule turns."""
    reports_when: Literal["below", "above"]
    """``below``: values under the threshold are the problem (SQNR, speed); ``above``: values over it."""
    margin: float
    """Half-width of the borderline band around ``threshold``, in the metric's unit (or, with
    ``relative``, as a fraction of the threshold)."""
    relative: bool = False
    """The band is ``threshold × (1 ± margin)``: for ratios, whose noise grows with their size."""
    unit: str = ""
    """Printed after values (``dB``); empty for ratios and shares."""

    @property
    def band(self) -> float:
        """The band's half-width in the metric's unit."""
        return self.margin * abs(self.threshold) if self.relative else self.margin

    def judge(self, value: float) -> Outcome:
        """``reported`` beyond the band, ``borderline`` inside it, ``clear`` on the safe side (and for NaN)."""
        if math.isnan(value):
            return "clear"
        past = self.threshold - value if self.reports_when == "below" else value - self.threshold
        if past > self.band:
            return "reported"
        return "borderline" if past >= -self.band else "clear"

    def pick(self, rows: Sequence[T], value: Callable[[T], float]) -> tuple[list[T], bool]:
        """The rows the rule reports, or, when none is, its borderline rows (flag True); order kept.

        >>> THRESHOLDS["PRECISION_LOSS"].pick([("a", 30.0), ("b", 19.0), ("c", 4.0)], lambda r: r[1])
        ([('c', 4.0)], False)
        >>> THRESHOLDS["PRECISION_LOSS"].pick([("a", 30.0), ("b", 19.0)], lambda r: r[1])
        ([('b', 19.0)], True)
        """
        reported = [r for r in rows if self.judge(value(r)) == "reported"]
        if reported:
            return reported, False
        return [r for r in rows if self.judge(value(r)) == "borderline"], True

    def at(self, threshold: float) -> Threshold:
        """The same rule at a caller's threshold (``diagnose_step(sqnr_threshold_db=...)``), same margin."""
        return dataclasses.replace(self, threshold=float(threshold))

    def evidence(self, value: float) -> dict[str, Any]:
        """The ``judgement`` record every finding of this rule carries."""
        return {"metric": self.metric, "value": value, "threshold": self.threshold, "margin": self.band,
                "reports_when": self.reports_when, "outcome": self.judge(value)}

    def describe(self, value: float) -> str:
        """``19.2 dB, within ±1.5 dB of the 20 dB threshold`` (for borderline messages)."""
        unit = f" {self.unit}" if self.unit else ""
        return (f"{value:.3g}{unit}, within ±{self.band:.3g}{unit} of the {self.threshold:g}{unit} threshold "
                f"({self.metric} {self.reports_when} it is reported)")


THRESHOLDS: dict[RuleName, Threshold] = {
    "PRECISION_LOSS": Threshold(code="PRECISION_LOSS", metric="sqnr_db", threshold=20.0, reports_when="below",
                                margin=1.5, unit="dB"),
    "GRADIENT_UNDERFLOW": Threshold(code="GRADIENT_UNDERFLOW", metric="flushed_share", threshold=0.01,
                                    reports_when="above", margin=0.005),
    "SCALE_COLLAPSE": Threshold(code="SCALE_COLLAPSE", metric="late_skip_share", threshold=0.5,
                                reports_when="above", margin=0.1),
    "SLOW_LOW_PRECISION": Threshold(code="SLOW_LOW_PRECISION", metric="ratio_vs_fp32", threshold=0.9,
                                    reports_when="below", margin=0.12, relative=True),
    "PRECISION_LOSS_FP8": Threshold(code="PRECISION_LOSS", metric="sqnr_db", threshold=12.0, reports_when="below",
                                    margin=1.5, unit="dB"),
    "FP8_FLUSH": Threshold(code="FP8_FLUSH", metric="flush_fraction", threshold=0.01, reports_when="above",
                           margin=0.005),
    "SLOW_FP8_GEMM": Threshold(code="SLOW_FP8_GEMM", metric="ratio_vs_bf16", threshold=0.9, reports_when="below",
                               margin=0.12, relative=True),
}
"""The rules by name, one per code except PRECISION_LOSS's two (docs/findings.md lists the same table).

Why these margins: 1.5 dB is a 19 % change in the error's RMS, more than the difference that
kernels of another ISA make to one step's SQNR, yet small next to a real loss (the corpus's
culprits sit 10-40 dB under the threshold); half a percentage point of flushed share and a tenth of
the late skip share are a few entries or steps decided under rounding; 12 % of the speed ratio
either way (0.79-1.01) holds the spread of 512×512 matmul rounds timed on one thread's CPU clock with every
core of a 2-core machine busy (the lowest and highest of 8 rounds lay 10-17 % apart; ``diagnose/core/perf.py``).

``PRECISION_LOSS_FP8`` is PRECISION_LOSS's rule for an fp8 model: e4m3 keeps 3 mantissa bits, so
one cast alone is about 30 dB and a healthy fp8 GEMM output 20-28 dB from fp32 (e5m2 gradients
less); 12 dB (an error of a quarter of the signal) is a loss no rounding explains.  ``FP8_FLUSH``
uses the telemetry alarm's level: a healthy operand flushes about 1e-5 of its values, 1 % needs
outliers thousands of standard deviations out.  ``SLOW_FP8_GEMM`` has SLOW_LOW_PRECISION's band."""


def _sqnr(threshold: float) -> Threshold:
    return Threshold(code="PRECISION_LOSS", metric="sqnr_db", threshold=threshold, reports_when="below", margin=1.5,
                     unit="dB")


FORMAT_SQNR: dict[FormatName, Threshold] = {
    "fp16": _sqnr(53.0),
    "bf16": _sqnr(35.0),
    "fp8": _sqnr(11.0),
    "fp8-rowwise": _sqnr(14.0),
    "fp8-rowwise-gw-hp": _sqnr(15.0),
    "mxfp8": _sqnr(15.0),
    "nvfp4": _sqnr(2.0),
}
"""``ampkit preflight``'s SQNR rule per format: a module whose forward output's SQNR against fp32 falls below it
breaks the model in that format (``diagnose.preflight.judge``; gradient SQNR is reported, not judged).

Each threshold is the lowest SQNR (of module forward outputs and of all gradients together) the format
gives on well-scaled models, minus 8 dB, rounded down
(``benchmarks/derive_format_thresholds.py``: LayerNorm'd MLP stacks and small GPTs at their default
initialisation, three seeds each; measured 61.2, 43.4, 19.9, 22.9, 23.2, 23.2 and 10.8 dB in the order
above).  8 dB is an error 2.5 times the RMS of the worst well-scaled module's: room for deeper models,
whose errors add up over more layers, yet far above the 20-60 dB that a layer breaking costs.  The
band is PRECISION_LOSS's (±1.5 dB), for the same reason.  NVFP4's rule is nearly silent: its healthy
SQNR is already low, and its breaks show as flushed operands and non-finite values instead."""

MODEL_OUTPUT_SQNR = _sqnr(19.0)
"""preflight's SQNR rule for the model's own output, which the loss reads.  On the preflight corpus (ten
models trained 30 steps per format against fp32, a regression loss judged by verify's 3 % loss tolerance)
every run whose output sat at 17.3 dB or below failed, and every run at 18.4 dB or above passed unless its
gradients were broken (which the gradient rule judges); 19 dB with the ±1.5 dB band puts the line between.  A format threshold above it (fp16's 53 dB) would call a
drop no loss notices a break (a top-1 router flipping a few tokens in fp16)."""

FORMAT_OUTPUT_SQNR: dict[FormatName, Threshold] = {
    **{name: MODEL_OUTPUT_SQNR for name in ("fp16", "bf16", "fp8", "fp8-rowwise", "fp8-rowwise-gw-hp", "mxfp8")},
    "nvfp4": FORMAT_SQNR["nvfp4"],
}
"""The model-output rule per format: ``MODEL_OUTPUT_SQNR``, except for NVFP4, whose healthy outputs (13-17 dB on
the corpus and the threshold benchmark) already sit below it; NVFP4 keeps its own threshold."""

FORMAT_FLUSH: dict[FormatName, Threshold] = {
    **{name: THRESHOLDS["FP8_FLUSH"] for name in ("fp8", "fp8-rowwise", "fp8-rowwise-gw-hp", "mxfp8")},
    "nvfp4": Threshold(code="FP8_FLUSH", metric="flush_fraction", threshold=0.45, reports_when="above", margin=0.05),
}
"""The share of a quantized Linear operand's non-zero values flushed to zero beyond which a scaled format breaks
the layer.  The fp8 recipes and MXFP8 keep FP8_FLUSH's level (a healthy operand flushes at most about 1 %).
NVFP4's two-bit elements flush everything under a sixth of a 16-value block's largest magnitude (a
quarter of its smallest step): 7 % of Gaussian values, 15 % of a GELU's output, up to 28 % of a
healthy GPT operand (the same benchmark), so its level is 45 %, past what a healthy model shows by
more than the ±5 % band."""


def is_borderline(finding: Finding | dict[str, Any]) -> bool:
    """Whether a finding (object or JSON dict) is a borderline info row."""
    evidence = finding.evidence if isinstance(finding, Finding) else finding.get("evidence") or {}
    severity = finding.severity if isinstance(finding, Finding) else finding.get("severity")
    return severity == "info" and bool(evidence.get("borderline"))


def as_borderline(finding: Finding, rule: Threshold, value: float) -> Finding:
    """``finding`` restated as a borderline info row: same code, module and evidence, no call to act.

    >>> f = Finding(code="PRECISION_LOSS", severity="warning", message="head's output is 19.0 dB", fix="keep it")
    >>> b = as_borderline(f, THRESHOLDS["PRECISION_LOSS"], 19.0)
    >>> b.severity, b.evidence["borderline"], b.message.startswith("borderline")
    ('info', True, True)
    """
    message = (f"borderline, {rule.describe(value)}: {finding.message}. Another CPU's kernels can move this value "
               "across the threshold, so it is reported as information, the same on every machine")
    fix = ("Nothing to change on this evidence alone. If results matter at this level, confirm with "
           f"`ampkit verify` against fp32; the remedy when it is real: {finding.fix}")
    evidence = {**finding.evidence, "judgement": rule.evidence(value), "borderline": True}
    return dataclasses.replace(finding, severity="info", message=message, fix=fix, evidence=evidence)
