"""One format's verdict: replay, find the breaks, search and verify the smallest policy that removes them.

1. Replay the steps under the format (``judge.replay_format``; for fp16 at the scaler's default initial
   scale), with the doctor's keep-fp32 / fp8-filter bisection on.
2. No break (``judge.breaks_of``): ``safe``.
3. Otherwise a policy: start from the doctor's verified proposal, if it made one, and the layers where the
   format broke; for fp16, when the default scale overflowed the backward, the recommended initial scale.
   Replay with the policy applied as the engine applies it; a layer that still breaks is added and the
   policy replayed again, for at most ``ROUNDS`` rounds.  The first policy under which nothing breaks is
   the verdict ``policy``, with the lowest module SQNR before and after.
4. A policy that would hold more than half the model's Linear layers (``policy_limit``), a break in code
   outside every module, or no clean replay within the rounds: ``unsafe``.

Cost: one replay (a traced step beside its fp32 shadow, per batch), plus one per policy round.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch
from torch import nn

from ampkit.diagnose.core.blockformats import is_block_format
from ampkit.diagnose.preflight.formats import FORMAT_SPECS
from ampkit.diagnose.preflight.fp32pass import Fp32Pass, recommended_scale
from ampkit.diagnose.preflight.judge import Replay, breaks_of, replay_format
from ampkit.diagnose.preflight.layers import layer_reports
from ampkit.diagnose.preflight.result import Break, FormatReport, Policy
from ampkit.diagnose.preflight.steps import PreflightStep
from ampkit.precision import FormatName

__all__ = ["ROUNDS", "assess_format", "policy_limit"]

ROUNDS = 4
"""Policy rounds before a format is called unsafe: each adds the layers still breaking."""


def policy_limit(model: nn.Module) -> int:
    """The most layers a policy may hold: half the model's Linear layers (at least one)."""
    return max(1, sum(isinstance(m, nn.Linear) for m in model.modules()) // 2)


def assess_format(model: nn.Module, steps: Sequence[PreflightStep], fmt: FormatName, fp32: Fp32Pass, *,
                  device: torch.device, default_scale: float) -> FormatReport:
    """The verdict of ``fmt`` on ``model`` (see the module docstring)."""
    start = time.perf_counter()
    spec = FORMAT_SPECS[fmt]
    scale = default_scale if fmt == "fp16" else None
    first = replay_format(model, steps, fmt, Policy(), device=device, loss_scale=scale, bisect=True)
    operands = _operand_stats(fp32, first, fmt)
    flushes = _flushes(operands) if spec.emulated else None
    found = breaks_of(first, flushes)
    report = FormatReport(format=fmt, verdict="safe", emulated=spec.emulated, first_break=found[0] if found else None,
                          grad_sqnr_db=None if math.isnan(first.grad_global_sqnr) else first.grad_global_sqnr)
    if fmt == "fp16":
        report.recommended_init_scale = recommended_scale(fp32.grad_absmax, default_scale)
        report.grad_underflow_at_init_scale = fp32.grad_underflow_share
    if found:
        report.findings = [f.to_dict() for r in first.results for f in r.findings]
        _search(model, steps, fmt, first, found, operands, report, device=device,
                        default_scale=default_scale)
    report.layers = layer_reports(fp32, first, operands, fmt, broken={b.module for b in found if b.module is not None},
                                  ineligible=_ineligible(model, fmt) if spec.emulated else {})
    report.seconds = time.perf_counter() - start
    return report


def _search(model: nn.Module, steps: Sequence[PreflightStep], fmt: FormatName, first: Replay,
            found: list[Break], operands: dict[str, dict[str, dict[str, float]]], report: FormatReport, *,
            device: torch.device, default_scale: float) -> None:
    """Fill ``report``'s verdict, policy and the SQNR before and after it."""
    spec = FORMAT_SPECS[fmt]
    limit = policy_limit(model)
    init_scale = None
    if fmt == "fp16" and any(b.kind == "loss_scale" for b in found):
        init_scale = report.recommended_init_scale
    layers: list[str] = []
    for result in first.results:
        _extend(layers, (result.keep_fp32 if spec.policy == "keep_fp32" else result.fp8_filter) or [])
    # A replay that went non-finite has no meaningful SQNR: -inf says "broken" in the same unit.
    broke = any(b.kind in ("error", "loss_scale") for b in found)
    report.policy_sqnr_db = {"before": float("-inf") if broke else first.lowest_sqnr, "after": None}
    replay = first
    for _ in range(ROUNDS):
        new = _layers_for(found, replay, spec.policy)
        if new is None:
            break  # a break outside every module: no layer to keep out of the format
        if replay is not first and not set(new) - set(layers):
            break  # nothing new to keep out, and the last policy did not hold
        _extend(layers, new)
        if len(layers) > limit:
            break
        policy = Policy(keep_fp32=list(layers) if spec.policy == "keep_fp32" else [],
                        fp8_filter=list(layers) if spec.policy == "fp8_filter" else [], init_scale=init_scale)
        replay = replay_format(model, steps, fmt, policy, device=device,
                               loss_scale=(init_scale or default_scale) if fmt == "fp16" else None, bisect=False)
        kept = set(layers)
        found = breaks_of(replay, _flushes({k: v for k, v in operands.items() if k not in kept})
                          if spec.emulated else None)
        if not found:
            report.verdict, report.policy = "policy", policy
            report.policy_sqnr_db["after"] = replay.lowest_sqnr
            return
    report.verdict = "unsafe"


def _layers_for(found: list[Break], replay: Replay, kind: str) -> list[str] | None:
    """The layers to add for ``found``: for fp8_filter, the quantized Linear layers at or under the broken
    module (or its nearest ancestor that holds some); for keep_fp32, the module.  None when a break has no
    module (the loss, code outside the model) or names the whole model."""
    out: list[str] = []
    for b in found:
        if b.kind == "loss_scale":
            continue  # the recommended initial scale answers it
        if not b.module:
            return None
        if kind == "keep_fp32":
            out.append(b.module)
            continue
        prefix = b.module
        while True:
            under = [q for q in replay.quantized if q == prefix or q.startswith(prefix + ".") or not prefix]
            if under or not prefix:
                break
            prefix = prefix.rpartition(".")[0]
        if not prefix:
            return None
        out.extend(under)
    return out


def _extend(into: list[str], names: Sequence[str]) -> None:
    into.extend(n for n in names if n not in into)


def _operand_stats(fp32: Fp32Pass, replay: Replay, fmt: FormatName) -> dict[str, dict[str, dict[str, float]]]:
    """Layer -> operand -> Transformer Engine's statistics, for the layers the format quantizes."""
    if FORMAT_SPECS[fmt].scaling == "none":
        return {}
    from ampkit.diagnose.core.blockcast import operand_stats  # torchao's casts: the scaled formats only

    return {layer: {name: operand_stats(t, fmt, dim=-1) for name, t in fp32.operands[layer].items()}
            for layer in replay.quantized if layer in fp32.operands}


def _ineligible(model: nn.Module, fmt: FormatName) -> dict[str, str]:
    from ampkit.diagnose.core.blockcast import ineligible_layers

    return ineligible_layers(model, fmt) if is_block_format(fmt) else {}


def _flushes(operands: dict[str, dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {layer: {name: stats["underflows%"] / 100.0 for name, stats in ops.items()}
            for layer, ops in operands.items()}
