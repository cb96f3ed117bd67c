"""MXFP8 and NVFP4, the block-scaled formats ampkit emulates, and the one cast through torchao.

A block-scaled format stores each run of ``block_size`` consecutive values along a GEMM's
reduction dimension as small floats (the *elements*) sharing one scale.  ampkit does not train
these formats; ``ampkit preflight`` emulates them with torchao 0.18's own casts (the CPU-capable
"emulated" path of its training code) so that a model can be judged before anyone trains it:

* **mxfp8** (``BLOCK_FORMATS["mxfp8"]``): e4m3 elements for input, weight and grad_output
  (``torchao/prototype/moe_training/mxfp8_linear.py:61-63``), blocks of 32 (line 64), one e8m0
  (power-of-2) scale per block computed by ``ScaleCalculationMode.RCEIL`` (``MXFP8Linear``'s default,
  line 281, and ``MXFP8TrainingRecipe.MXFP8_RCEIL``): ``2**ceil(log2(amax / 448))``, so the block's
  largest value never exceeds 448 after scaling;
* **nvfp4** (``BLOCK_FORMATS["nvfp4"]``): e2m1 elements for all three operands, blocks of 16, one
  e4m3 scale per block relative to a float32 per-tensor scale ``amax / (448 * 6)``
  (``nvfp4_tensor.per_tensor_amax_to_scale``, which NVFP4 training applies to each operand:
  ``moe_training/nvfp4_training/nvfp4_linear.py:50,124,199-200``); an all-zero tensor gets the
  per-tensor scale 1, as the training kernels do (``nvfp4_training/hadamard_utils.py:238-243``).

``quantize_dequantize(x, fmt, dim=...)`` is the round trip of ``x`` through that cast with the
blocks along ``dim`` (the GEMM's reduction dimension), and ``_block_cast`` is the only place that
calls torchao's casts (``MXTensor.to_mx``, ``NVFP4Tensor.to_nvfp4``).  The values are cast from
float32 (``to_mx`` and ``nvfp4_quantize`` convert a bf16 input to float32 first, so this changes
nothing for bf16; an fp16 or fp64 input, which torchao refuses, is widened or narrowed to float32).
A length along ``dim`` that is not a multiple of the block (the token dimension of a weight-gradient
GEMM) is padded with zeros, which leave each block's amax unchanged, and cut off again afterwards.

What the emulation leaves out of torchao's NVFP4 *training* kernels (``nvfp4_linear.py``), which need
a Blackwell GPU: the random Hadamard transform of the weight-gradient GEMM's operands, stochastic
rounding of grad_output, 16x16 (not 1x16) weight blocks, and the cast of fp32 operands to bf16
before quantizing.  Each makes real NVFP4 training somewhat more accurate than this emulation, or
differently rounded; the statistics are those of ``NVFP4Tensor.to_nvfp4``, the cast torchao ships.

torchao is imported on the first cast (about 2 s), through ``ampkit.fp8.import_torchao``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal, TypeGuard, get_args

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ampkit.fp8 import import_torchao

__all__ = ["BLOCK_FORMATS", "BlockFormatName", "BlockFormatSpec", "Operand", "is_block_format", "quantize_dequantize",
           "top_step"]

BlockFormatName = Literal["mxfp8", "nvfp4"]
"""The block-scaled formats ampkit emulates (what-if formats of ``ampkit preflight``)."""
Operand = Literal["input", "weight", "grad_output"]
"""The three operands a Linear layer's GEMMs cast: ``x``, ``W`` and the gradient of the output."""

_E4M3 = torch.finfo(torch.float8_e4m3fn)


@dataclass(frozen=True, kw_only=True)
class BlockFormatSpec:
    """One block-scaled format as torchao's training recipe uses it."""

    name: BlockFormatName
    elements: Mapping[Operand, torch.dtype]
    """The element type of each operand (``torch.float4_e2m1fn_x2`` is torchao's name for packed e2m1)."""
    block_size: int
    """Consecutive values along the GEMM's reduction dimension that share one scale."""
    scale_dtype: torch.dtype
    """How a block's scale is stored: e8m0 (a power of 2) for MX, e4m3 for NVFP4."""
    tensor_scale: bool
    """Whether the block scales are relative to a float32 per-tensor scale (NVFP4's second level)."""
    element_max: float
    """The element's largest finite magnitude: a block's amax lands at or below it after scaling."""
    element_top_step: float
    """The gap between ``element_max`` and the element value below it: a value scaled beyond ``element_max``
    by more than half of it is out of the format's range, not merely rounded."""
    element_min_normal: float
    """The element's smallest normal magnitude."""
    element_min_subnormal: float
    """The element's smallest non-zero magnitude: a value scaled below half of it rounds to zero."""

    @property
    def element(self) -> torch.dtype:
        """The element type (both formats use one for all three operands)."""
        return self.elements["input"]


def top_step(dtype: torch.dtype) -> float:
    """The gap between an fp8 dtype's largest value and the value below it (e4m3: 448 - 416 = 32)."""
    info = torch.finfo(dtype)
    return 2.0 ** math.floor(math.log2(info.max)) * info.eps


def _same_for_all(dtype: torch.dtype) -> Mapping[Operand, torch.dtype]:
    return MappingProxyType({operand: dtype for operand in get_args(Operand)})


BLOCK_FORMATS: dict[BlockFormatName, BlockFormatSpec] = {
    "mxfp8": BlockFormatSpec(
        name="mxfp8", elements=_same_for_all(torch.float8_e4m3fn), block_size=32, scale_dtype=torch.float8_e8m0fnu,
        tensor_scale=False, element_max=_E4M3.max, element_top_step=top_step(torch.float8_e4m3fn),
        element_min_normal=_E4M3.tiny, element_min_subnormal=_E4M3.tiny * _E4M3.eps),  # 2**-6 and 2**-9
    # e2m1: 1 sign, 2 exponent (bias 1), 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 (torch has no finfo for it)
    "nvfp4": BlockFormatSpec(
        name="nvfp4", elements=_same_for_all(torch.float4_e2m1fn_x2), block_size=16, scale_dtype=torch.float8_e4m3fn,
        tensor_scale=True, element_max=6.0, element_top_step=2.0, element_min_normal=1.0,
        element_min_subnormal=0.5),
}
"""Each block format's spec (see the module docstring for the torchao source of each field)."""


def is_block_format(name: str) -> TypeGuard[BlockFormatName]:
    """Whether ``name`` (a format name, e.g. ``ampkit.precision.FormatName``) is an emulated block format.

    >>> is_block_format("nvfp4"), is_block_format("fp8")
    (True, False)
    """
    return name in BLOCK_FORMATS


def quantize_dequantize(x: torch.Tensor, fmt: BlockFormatName, *, dim: int) -> torch.Tensor:
    """``x`` through ``fmt``'s cast with blocks along ``dim``, and back, in ``x``'s dtype.

    ``dim`` is the reduction dimension of the GEMM ``x`` enters: it is moved last (torchao blocks
    the last dimension), every other dimension flattened into rows, cast, dequantized in float32
    and put back in place.

    >>> x = torch.tensor([[1.0, 2.0, 3.0, 1000.0] * 8])
    >>> quantize_dequantize(x, "mxfp8", dim=-1)[0, :4].tolist()  # 1000 -> 1024: e4m3 has 3 mantissa bits
    [1.0, 2.0, 3.0, 1024.0]
    """
    return _round_trip(x, fmt, dim=dim).to(x.dtype)


def _round_trip(x: torch.Tensor, fmt: BlockFormatName, *, dim: int) -> torch.Tensor:
    """``quantize_dequantize`` in float32 (the emulated GEMMs multiply in float32)."""
    moved = x.movedim(dim, -1)
    _, back = _block_cast(moved.reshape(-1, moved.shape[-1]), fmt)
    return back.reshape(moved.shape).movedim(-1, dim)


def _block_cast(rows: torch.Tensor, fmt: BlockFormatName) -> tuple[Any, torch.Tensor]:
    """The 2-D ``rows`` (blocks along the last dimension) as torchao's ``MXTensor`` or ``NVFP4Tensor``, and
    dequantized again in float32 (``rows``' shape).

    The one call of torchao's casts.  Rows whose length is not a multiple of the block are padded
    with zeros: the torchao tensor holds the padded shape, the round trip is cut back to ``rows``'.
    The cast runs outside any ``TorchDispatchMode`` (the step doctor's op tracer): it stands for one
    hardware kernel, and its intermediate values are not the model's (RCEIL takes ``log2`` of an
    all-zero block's amax, -inf, which the tracer would report as an overflow).  The tracer sees the
    GEMMs on the round-tripped operands.
    """
    spec = BLOCK_FORMATS[fmt]
    with _disable_current_modes():
        data = rows.detach().to(torch.float32)
        short = -data.shape[1] % spec.block_size
        data = torch.nn.functional.pad(data, (0, short)) if short else data.contiguous()
        if fmt == "mxfp8":
            mx = import_torchao("torchao.prototype.mx_formats.mx_tensor")
            rceil = import_torchao("torchao.prototype.mx_formats.config").ScaleCalculationMode.RCEIL
            cast = mx.MXTensor.to_mx(data, spec.element, spec.block_size, rceil)
        else:
            nv = import_torchao("torchao.prototype.mx_formats.nvfp4_tensor")
            amax = data.abs().amax()
            tensor_scale = torch.where(amax == 0, torch.ones_like(amax), nv.per_tensor_amax_to_scale(amax))
            cast = nv.NVFP4Tensor.to_nvfp4(data, spec.block_size, per_tensor_scale=tensor_scale)
        return cast, cast.dequantize(torch.float32)[:, : rows.shape[1]]
