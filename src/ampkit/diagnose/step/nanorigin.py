"""Where a forward NaN is born: its cause, the inf that fed it, and the fix for that cause.

The NaN **birth** is the first forward op whose inputs hold no NaN and whose output does
(``ampkit.diagnose.step.events.find_producer(..., nan_only=True)``).  It is reported even
when an earlier op overflowed: the overflow explains an inf, the birth explains the NaN, and
their fixes differ (a softmax over a row that is entirely −inf is not cured by a wider format).

**What fed it.** When the birth's inputs hold ±inf, the inf is followed back through the ops
that merely passed it on to where it began: an op that overflowed (finite inputs, inf output),
an op given a non-finite constant (``masked_fill(mask, float("-inf"))``), or a tensor that
entered the step already holding it (data, a parameter).

**Causes** (``nan_cause``), each with its own fix (``nan_text``):

* ``masked_row``: a softmax / logsumexp over a row that is entirely −inf (an empty sequence in
  a padded batch, additive masks summed to −inf);
* ``softmax_of_inf``: a softmax over a row holding +inf (an overflowed logit: inf − inf);
* ``inf_minus_inf``: an add/sub/sum of +inf and −inf;
* ``zero_times_inf``: a product (or matmul) of 0 and ±inf, or inf/inf;
* ``negative_domain``: log, sqrt, rsqrt, pow or acos/asin of a value outside the domain;
* ``zero_over_zero``: a division of 0 by 0;
* ``other``: any other op.

>>> nan_text("masked_row", "float16")[0]
'a softmax over a row that is entirely −inf (an empty sequence in a padded batch, or additive masks that summed to −inf)'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ampkit._util.dtypes import dtype_name
from ampkit.diagnose.core.display import display_location, display_module
from ampkit.diagnose.step.trace import OpRecord, TraceLog

__all__ = ["InfSource", "cause_of", "inf_source", "nan_cause", "nan_text"]

_SOFTMAX = frozenset({"_softmax", "softmax", "_log_softmax", "log_softmax", "logsumexp", "_safe_softmax",
                      "_scaled_dot_product_attention_math", "_scaled_dot_product_flash_attention_for_cpu"})
_ADDITIVE = frozenset({"add", "add_", "sub", "sub_", "rsub", "sum", "mean", "cumsum", "nansum"})
_PRODUCT = frozenset({"mul", "mul_", "div", "div_", "mm", "bmm", "addmm", "baddbmm", "matmul", "linear",
                      "einsum", "dot", "mv", "addbmm", "_addmm_activation", "prod", "convolution",
                      "_convolution", "conv1d", "conv2d", "conv3d"})
_DOMAIN = frozenset({"log", "log2", "log10", "log1p", "sqrt", "rsqrt", "pow", "acos", "asin", "acosh", "atanh",
                     "xlogy", "lgamma", "digamma"})


@dataclass(frozen=True)
class InfSource:
    """Where the ±inf that fed a NaN began."""

    how: str
    """``overflow`` (an op turned finite inputs into ±inf), ``constant`` (an op was given a
    non-finite Python number) or ``input`` (it entered the step: data, a mask, a parameter)."""
    op: str | None
    module: str | None
    location: str | None
    op_index: int | None

    def describe(self) -> str:
        """``the −inf came from ...``: one clause for a finding's message."""
        where = f"{self.op} in {display_module(self.module)}"
        loc = f" ({display_location(self.location)})" if self.location else ""
        if self.how == "overflow":
            return f"the inf came from {where}{loc}, where finite inputs overflowed"
        if self.how == "constant":
            return f"the inf was written on purpose by {where}{loc} (a non-finite constant such as float('-inf'))"
        return f"the inf was already in a tensor entering the step, first used by {where}{loc}"

    def to_json(self) -> dict[str, Any]:
        return {"how": self.how, "op": self.op, "module": self.module,
                "location": display_location(self.location), "op_index": self.op_index}


def _inf_slots(log: TraceLog, rec: OpRecord) -> list[int]:
    return [s for s in rec.in_slots if log.slots[s].kind != "uninit" and any(log.state(s)[1:])]


def inf_source(log: TraceLog, rec: OpRecord) -> InfSource | None:
    """Follow an inf input of ``rec`` back to where it began; None when ``rec`` got no inf."""
    slots = _inf_slots(log, rec)
    for _ in range(len(log.records) + 1):  # each hop moves to an earlier op: bounded by the trace
        if not slots:
            return None
        info = log.slots[slots[0]]
        if info.op_index is None:
            return None
        src = log.records[info.op_index]
        if info.kind in ("input", "parameter", "buffer", "saved"):
            return InfSource("input", src.op, src.module, src.location, src.index)
        if src.scalar_nonfinite:
            return InfSource("constant", src.op, src.module, src.location, src.index)
        upstream = _inf_slots(log, src)
        if not upstream or any(log.state(s)[0] for s in src.in_slots):
            return InfSource("overflow", src.op, src.module, src.location, src.index)
        slots = upstream
    return None


def nan_cause(log: TraceLog, rec: OpRecord) -> str:
    """The cause of a NaN born at ``rec`` (see the module docstring)."""
    states = [log.state(s) for s in rec.in_slots if log.slots[s].kind != "uninit"]
    return cause_of(rec.op, pos_inf=any(s[1] for s in states), neg_inf=any(s[2] for s in states))


def cause_of(op: str, *, pos_inf: bool, neg_inf: bool) -> str:
    """The cause of a NaN that the aten op ``op`` (``aten::div`` or ``div``) made from NaN-free inputs
    holding +inf / -inf or not.

    >>> cause_of("aten::div", pos_inf=False, neg_inf=False), cause_of("aten::sub", pos_inf=True, neg_inf=True)
    ('zero_over_zero', 'inf_minus_inf')
    """
    short = op.split("::", 1)[-1]
    if pos_inf or neg_inf:
        if short in _SOFTMAX:
            return "softmax_of_inf" if pos_inf else "masked_row"
        if short in _ADDITIVE:
            return "inf_minus_inf"
        return "zero_times_inf" if short in _PRODUCT else "other"
    if short in _DOMAIN:
        return "negative_domain"
    if short in ("div", "div_", "remainder", "fmod"):
        return "zero_over_zero"
    return "other"


_TEXT: dict[str, tuple[str, str]] = {
    "masked_row": (
        "a softmax over a row that is entirely −inf (an empty sequence in a padded batch, or additive masks "
        "that summed to −inf)",
        "Mask with a finite minimum: build the mask as booleans and masked_fill once with "
        "torch.finfo(scores.dtype).min (not float('-inf')), or clamp a summed additive mask at that value "
        "(mask.clamp(min=torch.finfo(mask.dtype).min)); guard empty rows (skip fully padded sequences, or zero "
        "their output with torch.where)."),
    "softmax_of_inf": (
        "a softmax over a row holding +inf (an overflowed logit: inf − inf inside the softmax)",
        "Fix the overflow that produced the +inf (compute the logits in fp32, or scale q by 1/sqrt(d) before "
        "the matmul); the softmax itself is fine once its inputs are finite."),
    "inf_minus_inf": (
        "inf − inf (infinities that cancel in an add, subtract or sum, e.g. a row max of −inf subtracted "
        "from −inf)",
        "Keep both operands finite: compute them in fp32, or clamp each at torch.finfo(dtype).min/max "
        "before combining them."),
    "zero_times_inf": (
        "0 · inf (or inf / inf) in a product",
        "Keep the factor finite before the product (clamp it, or compute it in fp32); mask with "
        "torch.where(mask, x, 0) instead of multiplying by a 0/1 mask, which turns inf into NaN."),
    "negative_domain": (
        "log/sqrt/pow of a negative number (or acos/asin outside [−1, 1])",
        "Clamp the argument into the domain before the op (x.clamp_min(eps) before log/sqrt), and compute "
        "the quantity in fp32 with a stable formula (rounding in low precision is what pushed it below 0)."),
    "zero_over_zero": (
        "0 / 0",
        "Add an epsilon to the denominator, or guard it (torch.where(den > 0, num / den, 0)), and compute "
        "the ratio in fp32."),
    "other": (
        "an op that turned its inputs into NaN",
        "Compute the op in fp32 and guard its inputs (clamp, eps in denominators)."),
}


_CONSTANT_FIX = ("The inf is a constant written on purpose: mask with torch.finfo(x.dtype).min instead of "
                 "float('-inf'), so that a fully masked row stays finite, or guard fully masked rows (skip "
                 "them, or torch.where(row_has_any, x, 0)).")


def nan_text(cause: str, dtype: str | None, source: InfSource | None = None) -> tuple[str, str]:
    """(what happened, the fix) for a NaN of ``cause`` computed in ``dtype``, fed by ``source``."""
    what, fix = _TEXT.get(cause, _TEXT["other"])
    if dtype is not None and cause in ("negative_domain", "zero_over_zero", "other"):
        what = f"{what}, computed in {dtype_name(dtype)}"
    if source is not None and source.how == "constant" and cause != "masked_row":
        fix = _CONSTANT_FIX
    return what, fix
