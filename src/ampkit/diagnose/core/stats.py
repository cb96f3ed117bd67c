"""Range statistics of a tensor and its headroom in the low-precision formats.

For any floating tensor: largest finite magnitude, smallest non-zero finite magnitude,
NaN/+Inf/−Inf counts, the fraction of exact zeros, the fraction that would land in the
subnormal range (or flush to zero) of each format, and the headroom in log2 bits:

* bits to overflow  = log2(format max / absmax)          (< 0: values beyond the format's max)
* bits to underflow = log2(min_nonzero_abs / min normal) (< 0: values below the smallest normal)

Formats: fp16, bf16, fp8-e4m3 (``float8_e4m3fn``) and fp8-e5m2.  Everything is reduced from the
original tensor, before any cast to a smaller format: the magnitudes are taken in float32
(float64 for float64 tensors; upcasting fp16/bf16 is exact), counts in int64, on the tensor's
own device, as whole-tensor reductions (no per-element Python).  ``tensor_stats`` reads the
result back to the host once; the tracer uses ``pending_stats`` + ``finalize_many`` to keep
many reductions on the device and read them all back with a single transfer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ampkit._util.jsonfloat import NONFINITE_AS_STRING, to_json

__all__ = [
    "FORMATS",
    "FormatRange",
    "PendingStats",
    "TensorStats",
    "finalize_many",
    "finalize_ranges",
    "headroom",
    "merge_ranges",
    "pending_range",
    "pending_stats",
    "tensor_stats",
]


@dataclass(frozen=True)
class FormatRange:
    """Representable range of one floating-point format."""

    max: float
    """Largest finite value."""
    min_normal: float
    """Smallest positive normal value; below it precision degrades (subnormals), then flushes."""
    torch_dtype: torch.dtype


def _range(dtype: torch.dtype) -> FormatRange:
    info = torch.finfo(dtype)
    return FormatRange(max=float(info.max), min_normal=float(info.smallest_normal), torch_dtype=dtype)


FORMATS: dict[str, FormatRange] = {
    "fp16": _range(torch.float16),
    "bf16": _range(torch.bfloat16),
    "fp8_e4m3": _range(torch.float8_e4m3fn),
    "fp8_e5m2": _range(torch.float8_e5m2),
}
"""The formats every statistic reports headroom against, keyed by their short name."""

# Lower bound of the normal range per format, in FORMATS order: the subnormal counters use them.
_MIN_NORMALS = [FORMATS[k].min_normal for k in FORMATS]


@dataclass(frozen=True, kw_only=True)
class TensorStats:
    """Statistics of one tensor (see the module docstring for the definitions).

    >>> s = tensor_stats(torch.tensor([0.0, 1e-6, 2.0, 70000.0, float("nan")]))
    >>> s.absmax, s.nan, s.zero_frac
    (70000.0, 1, 0.2)
    >>> s.headroom_bits["fp16"][0] < 0       # 70000 > 65504: does not fit fp16
    True
    >>> round(s.subnormal_frac["fp16"], 2)   # 1e-6 is below fp16's smallest normal
    0.2
    """

    dtype: str
    """The tensor's dtype (``"torch.float32"``)."""
    numel: int
    absmax: float
    """Largest finite |x| (0.0 when there is none)."""
    min_nonzero_abs: float
    """Smallest finite non-zero |x| (``inf`` when there is none)."""
    nan: int
    posinf: int
    neginf: int
    zero_frac: float
    """Fraction of elements that are exactly zero."""
    subnormal_frac: dict[str, float]
    """Per format: fraction of all elements that are non-zero but below the format's smallest
    normal, i.e. that would be subnormal or flushed to zero after a cast."""
    headroom_bits: dict[str, tuple[float, float]]
    """Per format: (bits to overflow, bits to underflow), over the finite elements; ``inf``
    when the tensor has no non-zero finite element."""

    @property
    def finite(self) -> bool:
        return self.nan == 0 and self.posinf == 0 and self.neginf == 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (non-finite floats become the strings ``"inf"``, ``"-inf"``, ``"nan"``)."""
        return to_json(
            {
                "dtype": self.dtype, "numel": self.numel, "absmax": self.absmax,
                "min_nonzero_abs": self.min_nonzero_abs, "nan": self.nan, "posinf": self.posinf,
                "neginf": self.neginf, "zero_frac": self.zero_frac,
                "subnormal_frac": dict(self.subnormal_frac),
                "headroom_bits": {k: list(v) for k, v in self.headroom_bits.items()},
            },
            NONFINITE_AS_STRING,
        )


@dataclass
class PendingStats:
    """On-device reductions of one tensor, not yet read back (see ``finalize_many``)."""

    dtype: str
    numel: int
    counts: torch.Tensor
    """int64 [nan, posinf, neginf, zeros, below-normal per format...]."""
    values: torch.Tensor
    """float [absmax over finite, min non-zero |x| over finite]."""


def pending_stats(t: torch.Tensor) -> PendingStats:
    """Queue the reductions for ``t`` on its device; no host sync."""
    if not (t.is_floating_point() or t.is_complex()):
        t = t.to(torch.float32)
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    a = x.abs().to(acc)  # exact: every fp16/bf16/fp32 value is representable in float32
    finite = torch.isfinite(a)
    a_fin = torch.where(finite, a, torch.zeros((), dtype=acc, device=a.device))
    nonzero = a_fin > 0
    nan = torch.isnan(a).sum()
    inf_mask = torch.isinf(x)
    posinf = (inf_mask & (x > 0)).sum()
    neginf = (inf_mask & (x < 0)).sum()
    zeros = (x == 0).sum()
    below = [(nonzero & (a_fin < thr)).sum() for thr in _MIN_NORMALS]
    counts = torch.stack([nan, posinf, neginf, zeros, *below])
    if a.numel():
        absmax = a_fin.amax()
        min_nz = torch.where(nonzero, a_fin, torch.full((), math.inf, dtype=acc, device=a.device)).amin()
    else:
        absmax = torch.zeros((), dtype=acc, device=a.device)
        min_nz = torch.full((), math.inf, dtype=acc, device=a.device)
    return PendingStats(dtype=str(t.dtype), numel=t.numel(), counts=counts, values=torch.stack([absmax, min_nz]))


def pending_range(t: torch.Tensor) -> torch.Tensor:
    """[largest finite |x|, smallest finite non-zero |x|] of ``t``, queued on its device (no sync).

    The lean reduction behind per-module headroom (the full statistics take fifteen elementwise
    passes); magnitudes are exact (taken in the tensor's own dtype, then widened to float32).
    ``|t|`` is a fresh tensor, so the rest works on it in place: one allocation, not three, which
    halves the time (a replay takes this on every module's output).
    """
    a = t.detach().abs()
    if not a.is_floating_point():
        a = a.to(torch.float32)
    if a.numel() == 0:
        return torch.tensor([0.0, math.inf], device=a.device)
    a.nan_to_num_(nan=0.0, posinf=0.0)
    largest = a.amax()
    return torch.stack([largest, a.masked_fill_(a == 0, math.inf).amin()]).to(torch.float32)


def merge_ranges(items: list[torch.Tensor]) -> torch.Tensor:
    """The range of the union of several tensors' ranges (still on the device)."""
    if len(items) == 1:
        return items[0]
    rows = torch.stack(items)
    return torch.stack([rows[:, 0].amax(), rows[:, 1].amin()])


def finalize_ranges(items: list[torch.Tensor]) -> list[tuple[float, float]]:
    """Read ranges back with one transfer: [(absmax, min_nonzero_abs)]."""
    if not items:
        return []
    rows = torch.stack([r.to(items[0].device) for r in items]).cpu().tolist()
    return [(float(a), float(b)) for a, b in rows]


def finalize_many(items: list[PendingStats]) -> list[TensorStats]:
    """Read all pending statistics back to the host with one transfer per device."""
    if not items:
        return []
    dev = items[0].values.device
    wide = torch.float32 if dev.type == "mps" else torch.float64  # keep float64 inputs' tiny values
    counts = torch.stack([p.counts.to(dev) for p in items]).cpu().tolist()
    values = torch.stack([p.values.to(dev, wide) for p in items]).cpu().tolist()
    return [_build(p, c, v) for p, c, v in zip(items, counts, values)]


def tensor_stats(t: torch.Tensor) -> TensorStats:
    """Range statistics and headroom of ``t`` (one host read-back; see the module docstring)."""
    return finalize_many([pending_stats(t)])[0]


def _build(p: PendingStats, counts: list[int], values: list[float]) -> TensorStats:
    nan, posinf, neginf, zeros, *below = counts
    absmax, min_nz = float(values[0]), float(values[1])
    n = max(p.numel, 1)
    return TensorStats(
        dtype=p.dtype, numel=p.numel, absmax=absmax, min_nonzero_abs=min_nz, nan=int(nan), posinf=int(posinf),
        neginf=int(neginf), zero_frac=zeros / n,
        subnormal_frac={name: b / n for name, b in zip(FORMATS, below)},
        headroom_bits={name: headroom(absmax, min_nz, fr) for name, fr in FORMATS.items()},
    )


def headroom(absmax: float, min_nonzero_abs: float, fmt: FormatRange) -> tuple[float, float]:
    """(bits to overflow, bits to underflow) of values spanning [min_nonzero_abs, absmax] in ``fmt``.

    >>> [round(b, 3) for b in headroom(1024.0, 2.0**-10, FORMATS["fp16"])]
    [5.999, 4.0]
    """
    ovf = math.log2(fmt.max / absmax) if absmax > 0 else math.inf
    unf = math.log2(min_nonzero_abs / fmt.min_normal) if 0 < min_nonzero_abs < math.inf else math.inf
    return ovf, unf
