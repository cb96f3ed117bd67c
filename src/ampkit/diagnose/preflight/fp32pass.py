"""The fp32 pass: each module's forward range and the model's gradient range, before any format is tried.

One forward + backward per step (a sample batch, or a step captured from a script) on an fp32 copy, autocast off.  Per module, the statistics of
its forward outputs (``diagnose.core.stats``: largest |x|, and the share of non-zero values below each
format's smallest normal); for the whole model, the largest |gradient| of any module output or parameter
at scale 1, and how many non-zero gradient values a given fp16 loss scale flushes to zero.  From the
last two come fp16's recommended initial scale and the underflow at the scaler's default.

Cost: one plain fp32 step per batch, plus about fifteen elementwise passes per module output (the full
statistics) and four per gradient; everything is read back once per batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ampkit.diagnose.core.blockformats import Operand
from ampkit.diagnose.core.stats import TensorStats, finalize_many, pending_stats
from ampkit.diagnose.step.programs import StepProgram
from ampkit.diagnose.step.session import copy_model

__all__ = ["FP16_SMALLEST_SUBNORMAL", "Fp32Pass", "LossFn", "default_loss", "fp32_pass", "recommended_scale", "run_fp32"]

LossFn = Callable[[nn.Module, Any], torch.Tensor]
"""``loss_fn(model, batch) -> scalar loss``, as ``Task.loss``."""

FP16_SMALLEST_SUBNORMAL = 2.0**-24
_FP16_MAX = float(torch.finfo(torch.float16).max)


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss of a model that computes its own (a Hugging Face model given ``labels``): ``model(**batch)``
    for a dict, ``model(*batch)`` for a tuple or list, else ``model(batch)``; then the scalar it returned, or
    its ``.loss`` / ``["loss"]``."""
    out = model(**batch) if isinstance(batch, dict) else model(*batch) if isinstance(batch, (tuple, list)) else model(batch)
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", out)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shown = type(out).__name__ if not isinstance(out, torch.Tensor) else f"a tensor of shape {tuple(out.shape)}"
        raise ValueError(f"the model returned {shown}, not a scalar loss: pass loss_fn=lambda model, batch: ... "
                         "(or --loss on the command line) that returns the training loss")
    return loss.reshape(())


@dataclass(kw_only=True)
class Fp32Pass:
    """What the fp32 pass measured (see the module docstring)."""

    outputs: dict[str, TensorStats] = field(default_factory=dict)
    """Module -> its forward outputs' statistics, the widest over every batch (its largest absmax)."""
    module_types: dict[str, str] = field(default_factory=dict)
    grad_absmax: float = 0.0
    """Largest |gradient| of any module output or parameter, at scale 1."""
    grad_nonzero: int = 0
    grad_flushed: int = 0
    """Non-zero gradient values that ``flush_scale`` turns into fp16 zeros (below its smallest subnormal)."""
    flush_scale: float = 1.0
    losses: list[float] = field(default_factory=list)
    grad_energy: dict[str, float] = field(default_factory=dict)
    """Module -> the squared norm of its own parameters' fp32 gradients, summed over the steps: how much of
    the update each module carries (the gradient rule of ``judge.breaks_of`` weighs modules by it)."""
    operands: dict[str, dict[Operand, torch.Tensor]] = field(default_factory=dict)
    """``nn.Linear`` layer -> its fp32 ``input``, ``weight`` and ``grad_output`` from the first batch: what the
    quantized formats' operand statistics are computed from (one batch bounds the memory: one copy of
    every Linear's input and output gradient)."""

    @property
    def grad_underflow_share(self) -> float:
        return self.grad_flushed / self.grad_nonzero if self.grad_nonzero else 0.0


def recommended_scale(grad_absmax: float, default: float) -> float:
    """The largest power of two that keeps ``grad_absmax × scale`` a bit below fp16's largest value (one bit
    spare: a later step's gradients may be twice as large), at most 2^64; ``default`` without a gradient.
    Above the default it lifts gradients that the default flushes to zero (the scaler only backs off from it).

    >>> recommended_scale(11.8, 65536.0)
    2048.0
    >>> recommended_scale(1e-3, 65536.0)
    16777216.0
    """
    if not math.isfinite(grad_absmax) or grad_absmax <= 0:
        return default
    return float(min(2.0**64, 2.0 ** math.floor(math.log2(_FP16_MAX / 2 / grad_absmax))))


def fp32_pass(model: nn.Module, programs: Iterable[StepProgram], *, flush_scale: float,
              into: Fp32Pass | None = None) -> Fp32Pass:
    """Run every step program in fp32 on a copy of ``model`` and measure (see the module docstring); ``into``:
    a pass of earlier steps to add these to."""
    work = copy_model(model, fp32=True)
    result = into or Fp32Pass(flush_scale=flush_scale)
    names = {m: n for n, m in work.named_modules()}
    result.module_types = {n: type(m).__name__ for m, n in names.items()}
    for program in programs:
        _one_step(work, names, program, result)
    return result


def _one_step(work: nn.Module, names: dict[nn.Module, str], program: StepProgram, result: Fp32Pass) -> None:
    pending: dict[str, list[Any]] = {}
    grads: list[torch.Tensor] = []
    keep_operands = not result.losses  # the first step

    def keep_grad(g: torch.Tensor) -> None:
        grads.append(g.detach())

    def on_forward(module: nn.Module, inputs: Any, output: Any) -> None:
        tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        pending.setdefault(names[module], []).extend(pending_stats(t) for t in tensors)
        for t in tensors:
            if t.requires_grad:
                t.register_hook(keep_grad)
        if keep_operands and isinstance(module, nn.Linear) and isinstance(output, torch.Tensor) and inputs:
            _keep_operands(result.operands.setdefault(names[module], {}), module, inputs[0], output)

    handles = [m.register_forward_hook(on_forward) for m in names]
    try:
        loss = run_fp32(program, work)
    finally:
        for h in handles:
            h.remove()
    grads.extend(p.grad.detach() for p in work.parameters() if p.grad is not None)
    _add_energy(result.grad_energy, names)
    for p in work.parameters():
        p.grad = None
    _merge(result, pending, grads, math.nan if loss is None else float(loss.detach()))  # one read-back per step


def _add_energy(into: dict[str, float], names: dict[nn.Module, str]) -> None:
    owned = {names[m]: [p.grad.detach().float().pow(2).sum() for p in m.parameters(recurse=False) if p.grad is not None]
             for m in names}
    owned = {n: sums for n, sums in owned.items() if sums}
    if not owned:
        return
    values = torch.stack([torch.stack(sums).sum() for sums in owned.values()]).cpu().tolist()  # one read-back
    for name, value in zip(owned, values):
        into[name] = into.get(name, 0.0) + float(value)


def run_fp32(program: StepProgram, model: nn.Module) -> torch.Tensor | None:
    """One forward + backward of ``program`` on ``model`` in fp32, autocast off; the loss when it has one."""
    device_type = next((p.device.type for p in model.parameters()), "cpu")
    with torch.autocast(device_type, enabled=False):
        out = program.forward(model, fp32=True)
        program.backward(out, "fp32")
    return out.loss


def _keep_operands(into: dict[Operand, torch.Tensor], layer: nn.Linear, x: torch.Tensor, y: torch.Tensor) -> None:
    into["input"] = x.detach().reshape(-1, x.shape[-1])
    into["weight"] = layer.weight.detach()
    if y.requires_grad:
        y.register_hook(lambda g: into.__setitem__("grad_output", g.detach().reshape(-1, g.shape[-1])))


def _merge(result: Fp32Pass, pending: dict[str, list[Any]], grads: list[torch.Tensor], loss: float) -> None:
    keys = [(name, i) for name, items in pending.items() for i in range(len(items))]
    stats = finalize_many([s for items in pending.values() for s in items])
    for (name, _), s in zip(keys, stats):
        old = result.outputs.get(name)
        if old is None or s.absmax > old.absmax:
            result.outputs[name] = s
    if grads:
        rows = []
        for g in grads:
            a = g.abs().float()
            nonzero = a > 0
            rows.append(torch.stack([a.nan_to_num(0.0, 0.0, 0.0).amax(), nonzero.sum().float(),
                                     (nonzero & (a * result.flush_scale < FP16_SMALLEST_SUBNORMAL)).sum().float()]))
        absmax, nonzero_count, flushed = torch.stack(rows).cpu().double().T.tolist()
        result.grad_absmax = max(result.grad_absmax, max(absmax))
        result.grad_nonzero += int(sum(nonzero_count))
        result.grad_flushed += int(sum(flushed))
    result.losses.append(loss)
