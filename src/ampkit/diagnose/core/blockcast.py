"""The emulated block-format Linear, the swap that installs it, and operand statistics under Transformer
Engine's names.

``BlockFormatLinear`` is an ``nn.Linear`` whose forward runs ``_BlockFormatGemms``, an autograd
function that follows torchao's MX training convention (``mx_mm`` in
``torchao/prototype/moe_training/mxfp8_linear.py``) for each of a Linear layer's three GEMMs,
every operand round-tripped through the format (``blockformats.quantize_dequantize``) with its blocks
along that GEMM's reduction dimension:

* forward ``y = x @ W^T``: x and W blocked along in_features, K (``mxfp8_linear.py:123-139``);
* grad_input ``dx = dy @ W``: dy and W blocked along out_features, N (``:170-203``; W is transposed
  and made contiguous before its cast, line 183);
* grad_weight ``dW = dy^T @ x``: dy and x blocked along the tokens, M (``:225-255``);

each GEMM multiplied in float32 on the round-tripped operands with autocast off (torchao's emulated
kernel dequantizes and calls ``aten.mm``, ``mx_tensor.py:829-844``), the bias added afterwards in the
output's dtype (``MXFP8Linear.forward``, ``mxfp8_linear.py:304-305``).  On float32 operands the
mxfp8 layer is bit-identical to torchao's ``MXFP8Linear(kernel_preference=KernelPreference.EMULATED)``
(tests/diagnose/core/test_blockcast.py).  The output, and grad_input, come back in the input's dtype.

``to_block_format(model, fmt)`` swaps, in place, the class of each eligible ``nn.Linear``: in and out
features multiples of the block size (torchao's casts assert it, ``mx_tensor.py:230``,
``nvfp4_tensor.py:801``; the token dimension is padded instead).  The swap keeps parameters, hooks
and names, as ``diagnose.step.fp8`` needs to turn the layers back (``is_quantized_linear``).
``operand_stats`` measures what one cast does to one operand.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ampkit.diagnose.core.blockformats import (
    BLOCK_FORMATS,
    BlockFormatName,
    Operand,
    _block_cast,
    _round_trip,
    is_block_format,
    top_step,
)
from ampkit.fp8 import import_torchao, is_float8_linear
from ampkit.policy import resolve_keep_fp32
from ampkit.precision import FP8_RECIPES, FormatName
from ampkit.telemetry.fp8stats import fp8_round_trip, gemm_cast, operand_matrix

__all__ = ["BlockFormatLinear", "ineligible_layers", "is_block_format_linear", "is_quantized_linear",
           "operand_stats", "quantized_layer_names", "to_block_format"]

def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in float32 whatever autocast region the layer runs in (torchao's emulated GEMM)."""
    with torch.autocast(a.device.type, enabled=False):
        return torch.mm(a, b)


class _BlockFormatGemms(torch.autograd.Function):
    """``x @ W^T`` and its two backward GEMMs, each on operands round-tripped through the format."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, fmt: BlockFormatName) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.fmt = fmt
        rows = x.reshape(-1, x.shape[-1])
        out = _mm(_round_trip(rows, fmt, dim=-1), _round_trip(weight, fmt, dim=-1).t())
        return out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight = ctx.saved_tensors
        fmt: BlockFormatName = ctx.fmt
        dy = grad_output.reshape(-1, grad_output.shape[-1])
        rows = x.reshape(-1, x.shape[-1])
        grad_input = _mm(_round_trip(dy, fmt, dim=-1), _round_trip(weight, fmt, dim=0))
        grad_weight = _mm(_round_trip(dy, fmt, dim=0).t(), _round_trip(rows, fmt, dim=0))
        return grad_input.reshape(x.shape).to(x.dtype), grad_weight.to(weight.dtype), None


class BlockFormatLinear(nn.Linear):
    """An ``nn.Linear`` computed in an emulated block format (see the module docstring).

    >>> layer = BlockFormatLinear(64, 32, block_format="mxfp8")
    >>> layer(torch.randn(4, 64)).shape
    torch.Size([4, 32])
    """

    block_format: BlockFormatName
    """``mxfp8`` or ``nvfp4``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, block_format: BlockFormatName,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        reason = _ineligible(in_features, out_features, block_format)
        if reason:
            raise ValueError(f"BlockFormatLinear({in_features}, {out_features}, block_format={block_format!r}): "
                             f"{reason}; use an nn.Linear whose in and out features are multiples of "
                             f"{BLOCK_FORMATS[block_format].block_size}, or keep this layer an nn.Linear")
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.block_format = block_format

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        output = _BlockFormatGemms.apply(input, self.weight, self.block_format)
        return output if self.bias is None else output + self.bias.to(output.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, block_format={self.block_format!r}"


def is_block_format_linear(module: nn.Module) -> bool:
    """Whether ``module`` computes in an emulated block format (``BlockFormatLinear``)."""
    return isinstance(module, BlockFormatLinear)


def is_quantized_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a Linear layer in a low-precision GEMM format: torchao's ``Float8Linear`` or an
    emulated block format.  Both are ``nn.Linear`` subclasses that only override ``forward``."""
    return is_float8_linear(module) or is_block_format_linear(module)


def quantized_layer_names(model: nn.Module) -> list[str]:
    """The dotted names of ``model``'s ``is_quantized_linear`` layers, in model order (``""``: the model itself)."""
    return [name for name, m in model.named_modules() if is_quantized_linear(m)]


def _ineligible(in_features: int, out_features: int, fmt: BlockFormatName) -> str | None:
    block = BLOCK_FORMATS[fmt].block_size
    bad = [f"{what} {n}" for what, n in (("in_features", in_features), ("out_features", out_features)) if n % block]
    return f"{' and '.join(bad)} not a multiple of {fmt}'s block of {block}" if bad else None


def ineligible_layers(model: nn.Module, fmt: BlockFormatName) -> dict[str, str]:
    """``{name: reason}`` of the plain ``nn.Linear`` layers of ``model`` that ``fmt`` cannot compute.

    >>> ineligible_layers(nn.Sequential(nn.Linear(40, 64), nn.Linear(64, 32)), "mxfp8")
    {'0': "in_features 40 not a multiple of mxfp8's block of 32"}
    """
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and not is_quantized_linear(m):
            reason = _ineligible(m.in_features, m.out_features, fmt)
            if reason:
                out[name] = reason
    return out


def to_block_format(model: nn.Module, fmt: BlockFormatName, *, exclude: Sequence[str] = ()) -> list[str]:
    """Compute ``model``'s eligible Linear layers in ``fmt``, in place; returns their names, in model order.

    ``model`` is changed: pass a private copy.  ``exclude`` is resolved as ``fp8_filter`` is
    (``policy.resolve_keep_fp32``: module name patterns); a layer that is, or sits inside, a match
    stays an ``nn.Linear``, and so does each layer ``ineligible_layers`` names.  The swap assigns the
    class (torchao's ``Float8Linear`` conversion builds new modules; this keeps every reference valid).
    """
    if not is_block_format(fmt):
        raise ValueError(f"to_block_format(model, {fmt!r}): not a block format; use one of {sorted(BLOCK_FORMATS)}")
    kept = set(resolve_keep_fp32(model, list(exclude), what="fp8_filter")) if exclude else set()
    chosen = []
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear) or is_quantized_linear(m) or _ineligible(m.in_features, m.out_features, fmt):
            continue
        parts = name.split(".") if name else []
        if any(".".join(parts[:i]) in kept for i in range(len(parts) + 1)):
            continue
        m.__class__ = BlockFormatLinear
        if isinstance(m, BlockFormatLinear):  # always, now: tells the type checker what m became
            m.block_format = fmt
        chosen.append(name)
    return chosen


@torch.no_grad()
def operand_stats(x: torch.Tensor, fmt: FormatName, *, dim: int, operand: Operand = "input") -> dict[str, float]:
    """What one cast of ``fmt`` does to the operand ``x`` with its scaling along ``dim``, under Transformer
    Engine's debug-API names (``LogFp8TensorStats``, ``LogTensorStats``).

    ``fmt``: a block format (``mxfp8``, ``nvfp4``; blocks along ``dim``, any dimension of ``x``) or
    an fp8 recipe's precision name (``fp8``, ``fp8-rowwise``, ...): then the cast torchao's recipe makes
    of ``operand`` for the GEMM that reduces over ``dim`` (``telemetry.fp8stats.gemm_cast``: e4m3, or
    e5m2 for a tensorwise grad_output; a rowwise scale along ``dim``), with ``dim`` -1 or 0 of the 2-D
    operand (``x`` flattened to rows; a weight as ``[out_features, in_features]``).  The values:

    * ``underflows%``: the share (in %) of ``x``'s non-zero values that are zero after the cast (TE
      divides the same count by all elements);
    * ``overflows%``: the share (in %) of the values that are non-finite after the cast or were clamped
      at the element's largest value from beyond its range (more than half a step above it, where
      rounding alone would not have brought them).  With dynamic scaling it is ~0 for every finite
      operand: MXFP8's RCEIL block scale and fp8's current-amax scale put each value at or below the
      maximum; NVFP4's e4m3 block scale can round down, so a block's largest value may land up to
      6.25 % above 6 and be clamped to it, which is rounding (the next step would be 8), not overflow;
    * ``mse``: the mean squared error of the round trip against ``x``;
    * ``scale_inv_min``, ``scale_inv_max``: the smallest and largest scale that dequantizes, in float32:
      the block scales as torchao stores them (MX: the e8m0 ``scale``; NVFP4: ``get_hp_scales()``,
      the e4m3 block scale times the per-tensor scale), or fp8's ``1 / scale``;
    * ``dynamic_range``: ``log2(max |x|) - log2(min non-zero |x|)``, TE's definition (0 without a
      non-zero value), of ``x`` itself.

    An operand the recipe keeps in high precision for that GEMM loses nothing: zeros, scale 1.
    Reduced in float64 from ``x`` in float32; one host read.

    >>> stats = operand_stats(torch.tensor([[1e-6] + [1.0] * 31]), "mxfp8", dim=-1)
    >>> stats["underflows%"], stats["overflows%"], stats["scale_inv_max"], round(stats["dynamic_range"], 2)
    (3.125, 0.0, 0.00390625, 19.93)
    """
    x32 = x.detach().to(torch.float32)
    if is_block_format(fmt):
        return _block_stats(x32, fmt, dim=dim)
    recipe = next((r for name, r in FP8_RECIPES.items() if name == fmt), None)
    if recipe is None:
        raise ValueError(f"operand_stats(x, {fmt!r}): {fmt} has no scaled cast to measure; use a block format "
                         f"{sorted(BLOCK_FORMATS)} or an fp8 recipe {sorted(FP8_RECIPES)}")
    mat = operand_matrix(operand, x32)
    spec = gemm_cast(import_torchao("torchao.float8").Float8LinearConfig.from_recipe_name(recipe), operand,
                     _matrix_dim(x32, dim, operand))
    if spec is None:
        return _stats(mat, mat, torch.ones(()), torch.ones(()), range_end=torch.inf)
    back, scale = fp8_round_trip(mat, spec)
    return _stats(mat, back, 1.0 / scale, 1.0 / scale,
                  range_end=torch.finfo(spec.dtype).max + top_step(spec.dtype) / 2)


def _matrix_dim(x: torch.Tensor, dim: int, operand: Operand) -> int:
    """``dim`` of the operand ``x`` as a dim of its 2-D matrix (``operand_matrix``: a weight is transposed)."""
    last = dim in (-1, x.dim() - 1)
    if not last and not (x.dim() == 2 and dim in (0, -2)):
        raise ValueError(f"operand_stats: dim={dim} of a {x.dim()}-D {operand}; an fp8 scale runs along the last "
                         "dimension (dim=-1) or along the rows of a 2-D operand (dim=0): flatten it to 2-D first")
    if operand == "weight":
        return 0 if last else -1
    return -1 if last else 0


def _block_stats(x32: torch.Tensor, fmt: BlockFormatName, *, dim: int) -> dict[str, float]:
    spec = BLOCK_FORMATS[fmt]
    moved = x32.movedim(dim, -1)
    rows = moved.reshape(-1, moved.shape[-1])
    cast, back = _block_cast(rows, fmt)
    scales = cast.get_hp_scales() if spec.tensor_scale else cast.scale.to(torch.float32)
    per_value = scales.repeat_interleave(spec.block_size, dim=-1)[:, : rows.shape[1]]
    return _stats(rows, back, scales, per_value, range_end=spec.element_max + spec.element_top_step / 2)


def _stats(x: torch.Tensor, back: torch.Tensor, scale_inv: torch.Tensor, value_scale_inv: torch.Tensor, *,
           range_end: float) -> dict[str, float]:
    """The statistics of ``operand_stats`` from ``x``, its round trip ``back`` (both float32, one shape), the
    dequantizing scales, each value's scale (broadcastable to ``x``) and where the element's range ends
    (its largest value plus half a step: beyond it a value overflows rather than rounds)."""
    if x.numel() == 0:
        return dict.fromkeys(("underflows%", "overflows%", "mse", "scale_inv_min", "scale_inv_max",
                              "dynamic_range"), 0.0)
    ax = x.abs()
    nonzero = ax != 0
    nonzeros = nonzero.sum()
    beyond = ax > range_end * value_scale_inv
    amin = torch.where(nonzero, ax, torch.full_like(ax, torch.inf)).amin()
    has = nonzeros > 0
    top = torch.where(has, torch.log2(ax.amax()), 0.0)
    bottom = torch.where(has, torch.log2(amin), 0.0)
    values = torch.stack([
        (nonzero & (back == 0)).sum().double(), nonzeros.double(), (~torch.isfinite(back) | beyond).sum().double(),
        (back - x).double().square().sum(), scale_inv.amin().double(), scale_inv.amax().double(),
        (top - bottom).double(),
    ]).tolist()  # the one host read
    underflows, count, overflows, square_error, smin, smax, dynamic_range = values
    return {"underflows%": 100.0 * underflows / count if count else 0.0, "overflows%": 100.0 * overflows / x.numel(),
            "mse": square_error / x.numel(), "scale_inv_min": smin, "scale_inv_max": smax,
            "dynamic_range": dynamic_range}
