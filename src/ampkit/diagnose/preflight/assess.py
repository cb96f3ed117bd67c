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

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

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
NARROW_TRIALS = 3
"""Children of a broken container tried alone before the container itself is kept out (one replay each)."""


def policy_limit(model: nn.Module) -> int:
    """The most layers a policy may hold: half the model's Linear layers (at least one)."""
    return max(1, sum(isinstance(m, nn.Linear) for m in model.modules()) // 2)


def assess_format(model: nn.Module, steps: Sequence[PreflightStep], fmt: FormatName, fp32: Fp32Pass, *,
                  device: torch.device, default_scale: float, emulate: bool | None = None) -> FormatReport:
    """The verdict of ``fmt`` on ``model`` (see the module docstring); ``emulate``: ``judge.replay_format``'s."""
    start = time.perf_counter()
    spec = FORMAT_SPECS[fmt]
    scale = default_scale if fmt == "fp16" else None
    first = replay_format(model, steps, fmt, Policy(), device=device, loss_scale=scale, bisect=True, emulate=emulate)
    operands = _operand_stats(fp32, first, fmt)
    flushes = _flushes(operands) if spec.emulated else None
    found = breaks_of(first, fp32.grad_energy, flushes)
    report = FormatReport(format=fmt, verdict="safe", emulated=spec.emulated, gemm=first.gemm,
                          first_break=found[0] if found else None,
                          grad_sqnr_db=None if math.isnan(first.grad_global_sqnr) else first.grad_global_sqnr)
    if fmt == "fp16":
        report.recommended_init_scale = recommended_scale(fp32.grad_absmax, default_scale)
        report.grad_underflow_at_init_scale = fp32.grad_underflow_share
    if found:
        report.findings = [f.to_dict() for r in first.results for f in r.findings]
        _search(model, steps, fmt, first, found, operands, report, device=device, default_scale=default_scale,
                fp32=fp32)
    report.layers = layer_reports(fp32, first, operands, fmt, broken={b.module for b in found if b.module is not None},
                                  ineligible=_ineligible(model, fmt) if spec.emulated else {})
    report.seconds = time.perf_counter() - start
    return report


def _search(model: nn.Module, steps: Sequence[PreflightStep], fmt: FormatName, first: Replay,
            found: list[Break], operands: dict[str, dict[str, dict[str, float]]], report: FormatReport, *,
            device: torch.device, default_scale: float, fp32: Fp32Pass) -> None:
    """Fill ``report``'s verdict, policy and the SQNR before and after it."""
    spec = FORMAT_SPECS[fmt]
    limit = policy_limit(model)
    init_scale = _init_scale(found, report, default_scale) if fmt == "fp16" else None
    policy = Policy(init_scale=init_scale)
    for result in first.results:
        policy = _with(policy, (result.keep_fp32 if spec.policy == "keep_fp32" else result.fp8_filter) or [],
                       first, spec.policy)
    # A replay that went non-finite has no meaningful SQNR: -inf says "broken" in the same unit.
    broke = any(b.kind in ("error", "loss_scale") for b in found)
    report.policy_sqnr_db = {"before": float("-inf") if broke else first.lowest_sqnr, "after": None}

    def trial(candidate: Policy) -> tuple[Replay, list[Break]]:
        replay = replay_format(model, steps, fmt, candidate, device=device,
                               loss_scale=(candidate.init_scale or default_scale) if fmt == "fp16" else None,
                               bisect=False, emulate=first.gemm == "emulated")
        kept = set(candidate.layers())
        flushes = _flushes({k: v for k, v in operands.items() if k not in kept}) if spec.emulated else None
        return replay, breaks_of(replay, fp32.grad_energy, flushes)

    tried = policy
    for round_ in range(ROUNDS):
        if round_ > 0 or not policy.layers():  # the doctor's verified proposal, when it made one, is tried alone first
            modules = _modules_for(found)
            if modules is None:
                break  # a break outside every module, or in the whole model: no layer to keep out of the format
            for module in modules:
                policy = _with(policy, [_narrowed(module, policy, first, spec.policy, trial)], first, spec.policy)
        if round_ > 0 and policy == tried:
            break  # nothing new to keep out, and the last policy did not hold
        if len(policy.keep_fp32) + len(policy.fp8_filter) > limit:
            break
        tried = policy
        replay, found = trial(policy)
        if not found:
            report.verdict, report.policy = "policy", policy
            report.policy_sqnr_db["after"] = replay.lowest_sqnr
            return
    report.verdict = "unsafe"


def _init_scale(found: list[Break], report: FormatReport, default_scale: float) -> float | None:
    """fp16's initial scale: the recommended one where the default overflows the backward (it is lower) or
    flushes the gradients to zero (it is higher)."""
    recommended = report.recommended_init_scale
    if recommended is None:
        return None
    if any(b.kind == "loss_scale" for b in found) and recommended < default_scale:
        return recommended
    if any(b.reason.startswith("GRADIENT_UNDERFLOW") for b in found) and recommended > default_scale:
        return recommended
    return None


def _modules_for(found: list[Break]) -> list[str] | None:
    """The modules to keep out next for ``found``: every error's, else the first break's (a later break is often
    the first one's consequence, and the next round sees whether it stays).  Breaks the initial scale answers
    are left out: the loss scale's, fp16's flushed gradients and the damaged gradient they leave.  A module
    that holds another one named is dropped.  None when a break has no module, or names the whole model and
    nothing else."""
    scaled = any(b.kind == "loss_scale" or b.reason.startswith("GRADIENT_UNDERFLOW") for b in found)
    left = [b for b in found if b.kind != "loss_scale" and not b.reason.startswith("GRADIENT_UNDERFLOW")
            and not (scaled and b.kind == "gradient")]
    errors = [b for b in left if b.kind == "error"]
    named = [b.module for b in (errors or left[:1])]
    if any(m is None for m in named):
        return None
    modules = [m for m in dict.fromkeys(named) if m is not None]
    inner = [m for m in modules if m and not any(o != m and o.startswith(m + ".") for o in modules)]
    if modules and not inner:
        return None
    return inner


def _narrowed(module: str, policy: Policy, replay: Replay, kind: str,
              trial: Callable[[Policy], tuple[Replay, list[Break]]]) -> str:
    """``module``, or the first of its direct children (forward order, at most ``NARROW_TRIALS``) that alone
    fixes the step: a block's router rather than the whole block.  Only for keep_fp32; a quantized layer is
    already the smallest unit of fp8_filter."""
    if kind != "keep_fp32":
        return module
    children = [m for m in replay.forward_sqnr if m.rpartition(".")[0] == module]
    for child in children[:NARROW_TRIALS]:
        if not trial(_with(policy, [child], replay, kind))[1]:
            return child
    return module


def _with(policy: Policy, modules: Sequence[str], replay: Replay, kind: str) -> Policy:
    """``policy`` with ``modules`` kept out of the format: for fp16/bf16 in fp32; for the fp8 family and block
    formats, the quantized layers at or under each module out of the format (``fp8_filter``), and a module
    holding none (a router under bf16 autocast) in fp32.  A module inside one kept already adds nothing, and
    one that holds kept modules replaces them."""
    keep, filt = list(policy.keep_fp32), list(policy.fp8_filter)
    for module in modules:
        under = [q for q in replay.quantized if q == module or q.startswith(module + ".")]
        if kind == "keep_fp32" or not under:
            if any(module == k or module.startswith(k + ".") for k in keep):
                continue  # already inside a module kept in fp32
            keep = [k for k in keep if not k.startswith(module + ".")] + [module]
        else:
            _extend(filt, under)
    return dataclasses.replace(policy, keep_fp32=keep, fp8_filter=filt)


def _extend(into: list[str], names: Sequence[str]) -> None:
    into.extend(n for n in names if n not in into)


def _operand_stats(fp32: Fp32Pass, replay: Replay, fmt: FormatName) -> dict[str, dict[str, dict[str, float]]]:
    """Layer -> operand -> Transformer Engine's statistics, for the layers the format quantizes."""
    if FORMAT_SPECS[fmt].scaling == "none":
        return {}
    from ampkit.diagnose.core.blockcast import operand_stats  # torchao's casts: the scaled formats only

    return {layer: {name: operand_stats(t, fmt, dim=-1, operand=name) for name, t in fp32.operands[layer].items()}
            for layer in replay.quantized if layer in fp32.operands}


def _ineligible(model: nn.Module, fmt: FormatName) -> dict[str, str]:
    from ampkit.diagnose.core.blockcast import ineligible_layers

    return ineligible_layers(model, fmt) if is_block_format(fmt) else {}


def _flushes(operands: dict[str, dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {layer: {name: stats["underflows%"] / 100.0 for name, stats in ops.items()}
            for layer, ops in operands.items()}
