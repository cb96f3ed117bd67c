"""fp8 operand statistics: the amax and the flush fraction of every fp8 GEMM operand, sampled.

torchao's ``Float8Linear`` casts three operands to fp8 in each training step: the input and the
weight for the forward GEMM, and the gradient of the output (``grad_output``) for the two
backward GEMMs.  Each cast computes ``amax = max |x|`` (per tensor, or per row for the rowwise
recipe), turns it into ``scale = fp8_max / max(amax, 1e-12)`` and rounds ``x * scale`` to fp8.
Values much smaller than the amax round to zero: they are *flushed*, and their contribution to
the GEMM is lost.  For each operand of each layer ``Fp8Stats`` records, on sampled steps:

* the amax: ``max |x|`` of the operand as torchao reads it (before any scaling);
* the flushed and the non-zero element counts, whose ratio is the flush fraction: the share of
  the operand's non-zero values that are zero in an fp8 copy the recipe makes.

How the operands are seen, through module hooks only (torchao's code is not patched): the input
in a forward pre-hook (cast to the CUDA autocast dtype when that autocast is on, as
``Float8Linear.forward`` does), the weight from the module in the same hook (once per step: it
does not change between micro-batches), and ``grad_output`` in a tensor hook on the layer's
output (registered by a forward hook on sampled steps only; the bias add passes the gradient on
unchanged, so it is the gradient torchao casts).

The cast specs come from the layer's own ``Float8LinearConfig``: every cast the recipe makes of
an operand (e.g. rowwise scales the input per row for the forward GEMM and per column for the
weight-gradient GEMM) is replayed, with torchao's dtype per operand (tensorwise: e4m3 for input
and weight, e5m2 for grad_output; rowwise: e4m3 throughout, scales rounded down to powers of 2;
rowwise_with_gw_hp: rowwise's casts, but none for the weight-gradient GEMM, which takes the input
and grad_output in bf16).
An element counts as flushed when it is non-zero and zero in at least one of those copies.

Cost.  A step that is not sampled pays two Python hook calls per fp8 layer that return at once
(a few microseconds each, no kernel).  A sampled step pays, per operand and per distinct cast,
about six elementwise passes over the operand (abs, a max, the scaled product, the fp8 cast, a
zero test, a sum) plus a few scalar kernels: roughly as much as torchao's own casts, once more;
the temporaries (a float32 copy, an fp8 copy and a mask of the operand) live only inside the
hook.  Measured (``benchmarks/bench_fp8_telemetry.py``, a 9-layer GPT on one CPU thread): a sampled
step about 27 % longer, a step that is not sampled within the noise (+0.2 ms).  Nothing is read to the host: the counts land in a device accumulator that the
telemetry copies into its flushed rows at the step's boundary.

>>> import torch
>>> x = torch.tensor([[1000.0, 1e-4, 0.0, 1.0]])
>>> stats = operand_stats(x, (CastSpec(torch.float8_e4m3fn, None, False),))
>>> [float(v) for v in stats]  # amax, flushed, non-zero: 1e-4 * 448 / 1000 rounds to 0 in e4m3
[1000.0, 1.0, 3.0]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from ampkit._util.modhooks import own_hook
from ampkit.fp8 import is_float8_linear

__all__ = ["DEFAULT_EVERY", "OPERANDS", "CastSpec", "Fp8Stats", "cast_specs", "fp8_fields", "fp8_round_trip",
           "fp8_scale", "gemm_cast", "operand_matrix", "operand_stats", "rowwise_specs", "seen_input", "spec_scale"]

OPERANDS = ("input", "weight", "grad_output")
DEFAULT_EVERY = 100
"""Steps between samples when ``Telemetry(fp8_stats_every=None)`` finds fp8 layers: a sampled step costs
about one more set of torchao's casts, so this keeps the average cost below 1 % of the fp8 cast work."""
_EPS = 1e-12  # torchao's float8_utils.EPS: the smallest amax a scale is computed from
# (config attribute, dim of the 2-D operand torchao reduces over for a rowwise scale), per operand and GEMM.
# The 2-D operands are input.reshape(-1, in), weight.t() and grad_output.reshape(-1, out), as in torchao.
_USES = {
    "input": (("cast_config_input", -1), ("cast_config_input_for_grad_weight", 0)),
    "weight": (("cast_config_weight", 0), ("cast_config_weight_for_grad_input", -1)),
    "grad_output": (("cast_config_grad_output", -1), ("cast_config_grad_output_for_grad_weight", 0)),
}
_STATS = 3  # amax, flushed, non-zero


@dataclass(frozen=True)
class CastSpec:
    """One fp8 cast of an operand: the format, the reduction dim of a rowwise scale, power-of-2 scales."""

    dtype: torch.dtype
    """``torch.float8_e4m3fn`` or ``torch.float8_e5m2``."""
    dim: int | None
    """None: one scale for the tensor; else the dim of the 2-D operand the amax reduces over."""
    pow2: bool
    """The scale is rounded down to a power of 2 (torchao's ``round_scales_to_power_of_2``)."""


def cast_specs(config: Any, operand: str) -> tuple[CastSpec, ...]:
    """The distinct fp8 casts torchao's ``Float8LinearConfig`` makes of ``operand`` (empty: kept in high precision)."""
    specs: list[CastSpec] = []
    for _, dim in _USES[operand]:
        spec = gemm_cast(config, operand, dim)
        if spec is not None and spec not in specs:
            specs.append(spec)
    return tuple(specs)


def gemm_cast(config: Any, operand: str, dim: int) -> CastSpec | None:
    """The fp8 cast torchao's ``Float8LinearConfig`` makes of ``operand`` for the GEMM that reduces over
    ``dim`` (-1 or 0) of its 2-D matrix (``operand_matrix``'s orientation); None: that GEMM keeps it in
    high precision (``ScalingType.DISABLED``)."""
    attr = next(a for a, d in _USES[operand] if d == dim)
    cc = getattr(config, attr)
    if cc.scaling_type.value == "disabled":
        return None
    axiswise = cc.scaling_granularity.value == "axiswise"
    return CastSpec(cc.target_dtype, dim if axiswise else None, bool(config.round_scales_to_power_of_2))


def fp8_scale(amax: torch.Tensor, dtype: torch.dtype, *, pow2: bool = False) -> torch.Tensor:
    """The scale torchao derives from ``amax`` (``float8_utils.amax_to_scale``): fp8_max / max(amax, 1e-12).

    Divided in float64 and rounded to float32, as torchao does so that eager and compiled runs agree.
    """
    scale = (torch.finfo(dtype).max / torch.clamp(amax.to(torch.float64), min=_EPS)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale


def rowwise_specs(operand: str) -> tuple[CastSpec, ...]:
    """The casts torchao's ``rowwise`` recipe makes of ``operand``: e4m3, per row, power-of-2 scales
    (what ``fp8-rowwise`` would do to an operand a tensorwise run cast)."""
    return tuple(CastSpec(torch.float8_e4m3fn, dim, True) for _, dim in _USES[operand])


def spec_scale(ax: torch.Tensor, spec: CastSpec) -> torch.Tensor:
    """The scale torchao's cast ``spec`` applies to the 2-D operand whose magnitudes are ``ax``
    (one per tensor, or per row/column for a rowwise spec, broadcastable against ``ax``)."""
    amax = ax.max() if spec.dim is None else ax.amax(dim=spec.dim, keepdim=True)
    return fp8_scale(amax, spec.dtype, pow2=spec.pow2)


def operand_matrix(operand: str, x: torch.Tensor) -> torch.Tensor:
    """The 2-D matrix torchao casts for ``operand``: ``input``/``grad_output`` flattened to rows, ``weight.t()``."""
    return x.t() if operand == "weight" else x.reshape(-1, x.shape[-1])


def fp8_round_trip(x: torch.Tensor, spec: CastSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The 2-D float32 operand ``x`` through torchao's fp8 cast ``spec`` and back, and the scale it used.

    torchao's cast: ``x * scale``, clamped to the format's maximum, rounded to fp8; the round trip
    divides by the scale again.  The scale is one per tensor, or per row/column (``spec_scale``).
    """
    fmax = torch.finfo(spec.dtype).max
    scale = spec_scale(x.abs(), spec)
    return (x * scale).clamp(-fmax, fmax).to(spec.dtype).to(torch.float32) / scale, scale


def seen_input(x: torch.Tensor) -> torch.Tensor:
    """The input as ``Float8Linear.forward`` casts it: to the CUDA autocast dtype when that autocast is on
    (torchao tests ``torch.is_autocast_enabled()``, which is CUDA's; CPU autocast leaves it as it is).
    An ``fp8-rowwise-gw-hp`` layer's input arrives cast already under any autocast: ampkit's cast
    (``fp8recipes.autocast_input``) is a pre-hook from ``prepare``, which runs before those of the
    telemetry and the doctor."""
    return x.to(torch.get_autocast_dtype("cuda")) if torch.is_autocast_enabled("cuda") else x


@torch.no_grad()
def operand_stats(x: torch.Tensor, specs: Sequence[CastSpec]) -> torch.Tensor:
    """``[amax, flushed, non-zero]`` of the 2-D operand ``x`` under ``specs`` (float64, on ``x``'s device).

    The cast is of ``|x| * scale``: rounding is symmetric in the sign, and saturation (torchao clamps
    to the fp8 maximum) cannot make a value zero, so neither changes which elements flush.  An fp8
    value is zero iff its bits are 0 (``|x|`` has no negative zero).
    """
    ax = x.detach().abs()
    zeros = torch.eq(ax, 0).sum()
    flushed: torch.Tensor | None = None
    for spec in specs:
        bits = (ax.to(torch.float32) * spec_scale(ax, spec)).to(spec.dtype)
        zero = torch.eq(bits.view(torch.uint8), 0)
        flushed = zero if flushed is None else flushed.logical_or_(zero)
    lost = torch.zeros_like(zeros) if flushed is None else flushed.sum() - zeros
    return torch.stack([ax.max().double(), lost.double(), (x.numel() - zeros).double()])


class Fp8Stats:
    """Hooks on the ``Float8Linear`` layers of the watched models and the device accumulator of a sampled step.

    ``step()`` gives the optimizer step being recorded (1-based); steps 1, 1+K, 1+2K, ... are sampled
    (``every=K``, the schedule of ``module_absmax_every``).  ``take(step)`` hands over the step's
    accumulated ``(layers, 3 operands, [amax, flushed, non-zero])`` values, flattened, and resets them.
    """

    def __init__(self, device: torch.device, every: int | None, step: Callable[[], int], dtype: torch.dtype) -> None:
        self.device, self.dtype, self.step = device, dtype, step
        self.every = every
        """Steps between samples; None: ``DEFAULT_EVERY`` once an fp8 layer is found; 0: off."""
        self.names: list[str] = []
        self._specs: list[tuple[tuple[CastSpec, ...], ...]] = []
        self._layers: dict[int, int] = {}
        self._handles: list[Any] = []
        self._acc = self._blank(0)
        self._weights_done: set[int] = set()
        self._seen: int | None = None

    def _blank(self, layers: int) -> torch.Tensor:
        acc = torch.zeros((layers, len(OPERANDS), _STATS), dtype=self.dtype, device=self.device)
        acc[..., 0] = -math.inf  # amax of an operand not seen: -inf, then None in the record
        return acc

    def watch(self, models: Sequence[nn.Module]) -> None:
        """Hook the ``Float8Linear`` layers of ``models`` not hooked yet (a host walk; at prepare time)."""
        if self.every == 0:
            return
        new = 0
        for m_i, model in enumerate(models):
            prefix = f"model{m_i}." if len(models) > 1 else ""
            for name, module in model.named_modules():
                if id(module) in self._layers or not is_float8_linear(module):
                    continue
                i = self._layers[id(module)] = len(self.names)
                self.names.append(prefix + (name or "(root)"))
                self._specs.append(tuple(cast_specs(module.config, op) for op in OPERANDS))
                self._handles.append(module.register_forward_pre_hook(own_hook(module, partial(self._on_input, i))))
                self._handles.append(module.register_forward_hook(own_hook(module, partial(self._on_output, i))))
                new += 1
        if new:
            self._acc = torch.cat([self._acc, self._blank(new)])
            if self.every is None:
                self.every = DEFAULT_EVERY

    def sampled(self) -> bool:
        """Whether the step being recorded is sampled (host arithmetic only)."""
        every = self.every
        return bool(every) and torch.is_grad_enabled() and (self.step() - 1) % every == 0  # type: ignore[operator]

    def _add(self, i: int, op: int, x: torch.Tensor) -> None:
        specs = self._specs[i][op]
        if not specs or type(x) not in (torch.Tensor, nn.Parameter) or not x.is_floating_point():
            return  # not cast by the recipe, or already fp8 / a DTensor (FSDP2 fp8 all-gather, tensor parallel)
        stats = operand_stats(operand_matrix(OPERANDS[op], x), specs).to(self.dtype)
        row = self._acc[i, op]
        row[:1].copy_(torch.maximum(row[:1], stats[:1]))  # NaN propagates, as in torchao's amax
        row[1:].add_(stats[1:])
        self._seen = self.step()

    def _on_input(self, i: int, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not args or not isinstance(args[0], torch.Tensor) or not self.sampled():
            return
        self._add(i, 0, seen_input(args[0]))
        if i not in self._weights_done:
            self._weights_done.add(i)
            weight = module.weight
            if isinstance(weight, torch.Tensor):
                self._add(i, 1, weight)

    def _on_output(self, i: int, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad and self.sampled():
            output.register_hook(partial(self._on_grad_output, i))

    def _on_grad_output(self, i: int, grad: torch.Tensor) -> None:
        self._add(i, 2, grad)

    def take(self, step: int) -> torch.Tensor | None:
        """The flattened values accumulated for ``step`` (None: nothing was observed), reset for the next sample."""
        self._weights_done.clear()
        if self._seen != step or not self.names:
            return None
        values, self._acc = self._acc.reshape(-1), self._blank(len(self.names))
        self._seen = None
        return values

    @property
    def width(self) -> int:
        """Values per sampled row."""
        return len(self.names) * len(OPERANDS) * _STATS

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def fp8_fields(names: Sequence[str], row: Sequence[float]) -> dict[str, dict[str, dict[str, float | None]]]:
    """The record fields of one sampled row: ``fp8_amax`` and ``fp8_flush_fraction``, {layer: {operand: value}}.

    An operand not observed on the step (a layer that did not run, a backward that did not reach it,
    an operand the recipe keeps in high precision) is None in both.

    >>> fp8_fields(["0"], [2.0, 1, 4, -math.inf, 0, 0, 8.0, 0, 0])["fp8_flush_fraction"]
    {'0': {'input': 0.25, 'weight': None, 'grad_output': 0.0}}
    """
    amax: dict[str, dict[str, float | None]] = {}
    flush: dict[str, dict[str, float | None]] = {}
    for j, name in enumerate(names):
        amax[name], flush[name] = {}, {}
        for k, op in enumerate(OPERANDS):
            a, flushed, nonzero = row[(j * len(OPERANDS) + k) * _STATS:][:_STATS]
            seen = a != -math.inf
            amax[name][op] = a if seen else None
            flush[name][op] = (flushed / nonzero if nonzero else 0.0) if seen else None
    return {"fp8_amax": amax, "fp8_flush_fraction": flush}
