"""``EmulatedGemms``: low-precision GEMMs computed in fp32 on their operands, rounded to the real output dtype.

Why: a CPU without fp16 matrix instructions (``precision.cpu_has_fast_fp16()`` False) runs an fp16
matmul 40-160 times slower than fp32 (a 1024x1024 matmul, measured here), and an AVX2-only CPU
(``cpu_has_fast_bf16()`` False) does the same to bf16; a replay of a 20M-parameter GPT step under those formats then takes minutes.  Every fp16 and bf16
value is an fp32 value, so the same GEMM on the operands upcast to fp32, rounded once to the format at
the end, is what the real kernel computes, at fp32 speed.

What: a ``TorchDispatchMode`` that runs each op of ``GEMM_OPS`` whose floating inputs are all fp16 or all
bf16 (``_scaled_mm``: fp8) on its operands in fp32, then casts each output to the dtype the real op
returns (its meta kernel says which: the flash attention's logsumexp stays fp32; ``_scaled_mm``'s is its
``out_dtype``).  Everything else runs for real: every other op, a GEMM in fp32, a GEMM whose operands mix
dtypes (the real kernel raises the mismatch, with the message the doctor's DTYPE_MISMATCH reads) and one
whose shapes the meta kernel rejects (the real kernel raises its own error).

The ops, as torch 2.13 dispatches them on a CPU (``tests/diagnose/core/test_gemm_emulation.py`` checks
that these are what the model code reaches):

* ``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``mv``, ``addmv``, ``dot``: an autocast ``nn.Linear`` is
  ``addmm`` (after a ``view`` for a 3-D input), its backward ``mm``; ``@`` and ``torch.matmul`` are
  ``mm``, ``bmm``, ``mv`` or ``dot``.  ``aten::linear`` and ``aten::matmul`` are composite: they
  decompose before any dispatch mode sees them, so they need no entry.  ``addbmm`` is left out: its CPU
  kernel rounds the sum to the format after each batch, so an fp32 sum would not be its result;
* ``convolution`` and ``convolution_backward``: ``nn.Conv1d/2d/3d`` and their backward;
* ``_scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``: ``F.scaled_dot_product_attention``
  on a CPU.  Its math path (a CPU falls back to it for dropout, or under ``sdpa_kernel(MATH)``) casts
  fp16 and bf16 to fp32 itself on a CPU, so its ``bmm`` calls are fp32 already: nothing to emulate;
* ``_scaled_mm``: torchao's ``Float8Linear``.  Its operands are ``Float8TrainingTensor`` subclasses, whose
  ``mm`` reaches this mode first; the mode returns ``NotImplemented`` for every op on a tensor subclass,
  the subclass runs the op, and the ``_scaled_mm`` it calls on the fp8 data and inverse scales comes back
  through the mode stack as a plain op.  Emulated as torch defines it: ``(mat1 * scale_a) @ (mat2 *
  scale_b) + bias`` in fp32 (divided by ``scale_result`` for an fp8 output), cast to the output dtype.

Numerics (the test measures each against the real kernel):

* The real CPU kernels accumulate in fp32 too (oneDNN's bf16 GEMMs, ATen's fp16 fallback in its fp32
  ``opmath``), and round each output once; the emulation differs only in the order of the fp32 sums
  (fp32 sgemm's blocking against the low-precision kernel's).  That moves a result by fp32 rounding
  noise, which changes its rounding to the format only near a rounding boundary: by one step of the
  format, in a few elements.  Where every partial sum is exact in fp32 (small integer operands) the
  two are bitwise equal.
* Overflow is the real kernel's: an fp16 result beyond 65504 rounds to inf in the final cast, exactly
  as the real kernel's store rounds it.  Partial sums are fp32 in both, so neither overflows before
  that rounding.
* The flash attention's reduced-precision kernels round the softmax probabilities (and, in the backward,
  their gradient) to the format before the GEMMs that take them; the emulation keeps them in fp32: one
  rounding less, of the size of the real kernel's own rounding of its outputs.
* ``_scaled_mm``: torch's CPU kernel (on CPUs without AMX-INT8) is itself this computation, op for op,
  so the emulation is bitwise equal to it; on AMX CPUs oneDNN's fp8 path computes it, and the emulation
  keeps a replay's result independent of which CPU ran it.

Stacking with the op tracer (``diagnose.step.trace.OpTracer``): enter ``EmulatedGemms`` first, outside the
diagnosis, and the tracer inside it.  The mode entered last sees an op first, so the tracer records the op
as the model runs it (fp16 inputs, fp16 output, a non-finite value where the real kernel gives one) and
calls it; the call reaches this mode, whose fp32 ops run with both modes off the stack, so the tracer
never sees the upcasts.  The other way round, the tracer would record an fp32 ``mm`` between two casts.

Cost: each emulated op runs its meta kernel once (tens of microseconds; not ``_scaled_mm``) and holds an
fp32 copy of its operands and output (twice their low-precision memory); the GEMM itself runs at fp32
speed: 2-4 times slower than bf16 on a CPU with bf16 units (which is why ``gemms_slow`` decides where it
pays), tens of times faster than fp16 without fp16 units.  Every other op pays one Python call.

>>> import torch
>>> a = torch.full((2, 4), 256.0, dtype=torch.float16)
>>> with EmulatedGemms():
...     out = a @ a.t()  # 4 * 256 * 256 = 262144 > 65504
>>> out.dtype, out[0, 0].item()
(torch.float16, inf)
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ampkit.precision import cpu_has_fast_bf16, cpu_has_fast_fp16

__all__ = ["FP8_DTYPES", "GEMM_OPS", "LOW_PRECISION", "EmulatedGemms", "gemms_slow"]

aten = torch.ops.aten

GEMM_OPS = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten.mv.default, aten.addmv.default, aten.dot.default,
    aten.convolution.default, aten.convolution_backward.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_mm.default,
})
"""The ops computed in fp32 (their functional overloads: an ``out=`` variant runs for real)."""

LOW_PRECISION = frozenset({torch.float16, torch.bfloat16})
"""The operand dtypes an op of ``GEMM_OPS`` (other than ``_scaled_mm``) is emulated for."""

FP8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz})
"""The operand dtypes ``_scaled_mm`` is emulated for."""

_PLAIN = torch.Tensor.__torch_dispatch__
"""What a tensor class without a dispatch handler of its own has (``torch.Tensor``, ``nn.Parameter``)."""


def gemms_slow(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this device computes ``dtype``'s GEMMs slowly: a CPU without fp16 matrix instructions for
    fp16, one without bf16 instructions (``cpu_has_fast_bf16``: AVX2-only, or capped to it) for bf16 and fp8
    (whose recipes run their other GEMMs in bf16).  Accelerators: never."""
    if device.type != "cpu":
        return False
    return not (cpu_has_fast_fp16() if dtype == torch.float16 else cpu_has_fast_bf16())


class EmulatedGemms(TorchDispatchMode):
    """Compute the low-precision GEMMs of ``GEMM_OPS`` in fp32 (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.emulated: Counter[str] = Counter()
        """Op (``aten::mm``) -> how many of its calls were computed in fp32."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if any(t.__torch_dispatch__ is not _PLAIN for t in types):
            # A tensor subclass (torchao's Float8TrainingTensor) runs its own op; the plain ops it runs
            # (its _scaled_mm) come back through the mode stack.
            return NotImplemented
        if func not in GEMM_OPS or not _emulated_operands(func, args, kwargs):
            return func(*args, **kwargs)
        if func is aten._scaled_mm.default:
            out = _scaled_mm_fp32(*args, **kwargs)
        else:
            try:
                expected = func(*tree_map(_meta, args), **tree_map(_meta, kwargs))
            except Exception:  # a shape the op rejects: the real kernel raises its own error
                return func(*args, **kwargs)
            out = _cast_like(func(*tree_map(_upcast, args), **tree_map(_upcast, kwargs)), expected)
        self.emulated[func._schema.name] += 1
        return out


def _emulated_operands(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the op's operands are what the emulation computes: fp8 for ``_scaled_mm``; else floating operands
    all of one dtype of ``LOW_PRECISION`` (the flash attention backward's ``logsumexp``, fp32 by design, aside).
    A mix is a dtype mismatch: the real kernel raises it, with the message DTYPE_MISMATCH reads (meta kernels
    do not all check dtypes)."""
    if func is aten._scaled_mm.default:
        return isinstance(args[0], torch.Tensor) and args[0].dtype in FP8_DTYPES
    bound = [*zip((a.name for a in func._schema.arguments), args), *kwargs.items()]
    dtypes = {v.dtype for name, v in bound
              if isinstance(v, torch.Tensor) and v.is_floating_point() and name != "logsumexp"}
    return len(dtypes) == 1 and dtypes <= LOW_PRECISION


def _meta(x: Any) -> Any:
    return x.to("meta") if isinstance(x, torch.Tensor) else x


def _upcast(x: Any) -> Any:
    return x.float() if isinstance(x, torch.Tensor) and x.dtype in LOW_PRECISION else x


def _cast_like(out: Any, expected: Any) -> Any:
    """Each tensor of ``out`` in the dtype of its twin in ``expected`` (the real op's outputs, on meta)."""
    values, spec = tree_flatten(out)
    twins, _ = tree_flatten(expected)
    cast = [v.to(t.dtype) if isinstance(v, torch.Tensor) and isinstance(t, torch.Tensor) else v
            for v, t in zip(values, twins)]
    return tree_unflatten(cast, spec)


def _scaled_mm_fp32(mat1: torch.Tensor, mat2: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                    bias: torch.Tensor | None = None, scale_result: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None, use_fast_accum: bool = False) -> torch.Tensor:
    """``aten::_scaled_mm`` in fp32, op for op as torch's CPU kernel computes it (``_scaled_mm_out_cpu_emulated``):
    the operands made contiguous and dequantized by their (tensor- or row-wise) scales, one fp32 matmul, the
    bias added in fp32, for an fp8 output the division by ``scale_result``, and the cast to ``out_dtype``
    (default: ``mat1``'s).  ``use_fast_accum`` changes nothing on a CPU.  No meta kernel decides the output
    dtype here: ``_scaled_mm``'s asks for CUDA's dimensions (multiples of 16), which a CPU does not need and
    a weight-gradient GEMM over a batch's tokens does not have."""
    out = torch.mm(mat1.contiguous().float() * scale_a, mat2.contiguous().float() * scale_b)
    if bias is not None:
        out = out + bias
    if scale_result is not None and out_dtype in FP8_DTYPES:
        out = out * scale_result.reciprocal()
    return out.to(out_dtype or mat1.dtype)
