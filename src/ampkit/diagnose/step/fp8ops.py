"""fp8 operand statistics of one replayed step, and FP8_FLUSH.

For every ``Float8Linear`` layer and each operand torchao casts (input, weight, grad_output),
``OperandProbe`` measures, with the layer's own cast specs (``telemetry.fp8stats``: the same amax,
scale and flush computation as the telemetry):

* ``flush_fraction``: the share of the operand's non-zero values that round to zero after
  torchao's scaling (``operand_stats``);
* ``saturated_fraction``: the share beyond the format's maximum after scaling, or non-finite
  (torchao clamps them).  torchao 0.18's recipes scale dynamically from the current amax, so a
  finite operand never saturates (beyond rounding, tolerated here); the share is kept so that a
  non-finite operand, which turns the whole cast to zeros and NaN, shows in the table;
* ``sqnr_db``: the SQNR of the fp8 round trip (cast, clamp, divide by the scale) against the
  operand itself, the worst of the operand's casts;
* for a tensorwise layer, ``rowwise_flush_fraction``: the share ``fp8-rowwise`` would flush.

The operands are those of the fp8 run itself, seen through module hooks (torchao is not
patched), as the telemetry sees them.  Cost: one extra untraced step, and per operand and cast
about ten elementwise passes; the values stay on the device until one read at the end.

FP8_FLUSH is judged per layer on its worst operand's flush fraction against
``THRESHOLDS["FP8_FLUSH"]`` (with its borderline band).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from torch import nn

from ampkit.diagnose.core.display import display_module, fp8_filter_fix, preflight_hint
from ampkit.diagnose.step.compare import sqnr_db
from ampkit.diagnose.step.session import Session
from ampkit.findings import Finding
from ampkit.fp8 import is_float8_linear
from ampkit.precision import PrecisionName
from ampkit.telemetry.fp8stats import (
    CastSpec,
    cast_specs,
    fp8_round_trip,
    operand_matrix,
    operand_stats,
    rowwise_specs,
    seen_input,
)
from ampkit.thresholds import THRESHOLDS, as_borderline

__all__ = ["OperandProbe", "flush_findings", "operand_pass", "roundtrip_stats"]

_FORMATS = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
_ROUNDING = 1.0 + 1e-6  # amax * fp32(max / amax) can exceed max by an ulp: not a saturation


@torch.no_grad()
def roundtrip_stats(x: torch.Tensor, specs: tuple[CastSpec, ...]) -> torch.Tensor:
    """``[saturated, signal energy, noise energy]`` of the 2-D operand ``x`` under ``specs`` (float64).

    Saturated: beyond the format's maximum after scaling, or non-finite, under any of the casts.
    The noise is that of the worst cast (the signal is the same for all).

    >>> x = torch.tensor([[1.0, 2.0, 3.0, 1000.0]])
    >>> s = roundtrip_stats(x, (CastSpec(torch.float8_e4m3fn, None, False),))
    >>> int(s[0]), bool(s[1] > 1e3 * s[2])
    (0, True)
    """
    x32 = x.detach().to(torch.float32)
    saturated = ~torch.isfinite(x32)
    worst = torch.zeros((), dtype=torch.float64, device=x.device)
    for spec in specs:
        back, scale = fp8_round_trip(x32, spec)
        saturated |= (x32 * scale).abs() > torch.finfo(spec.dtype).max * _ROUNDING
        worst = torch.maximum(worst, torch.linalg.vector_norm(x32 - back).double().square())
    signal = torch.linalg.vector_norm(x32).double().square()
    return torch.stack([saturated.sum().double(), signal, worst])


class OperandProbe:
    """Hooks on ``model``'s ``Float8Linear`` layers for one run (a context manager); ``table()`` after it."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = [(n, m) for n, m in model.named_modules() if is_float8_linear(m)]
        self._acc: dict[tuple[str, str], torch.Tensor] = {}
        self._format: dict[tuple[str, str], str] = {}
        self._handles: list[Any] = []
        self._weights: set[str] = set()

    def __enter__(self) -> OperandProbe:
        for name, m in self.layers:
            self._handles.append(m.register_forward_pre_hook(partial(self._on_input, name)))
            self._handles.append(m.register_forward_hook(partial(self._on_output, name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _add(self, name: str, operand: str, module: nn.Module, x: torch.Tensor) -> None:
        specs = cast_specs(module.config, operand)
        if not specs or type(x) not in (torch.Tensor, nn.Parameter) or not x.is_floating_point():
            return  # kept in high precision by the recipe, or not a plain tensor (fp8 already, DTensor)
        mat = operand_matrix(operand, x.detach())
        row = [operand_stats(mat, specs), roundtrip_stats(mat, specs),
               torch.tensor([float(mat.numel())], dtype=torch.float64, device=mat.device)]
        if all(s.dim is None for s in specs):
            row.append(operand_stats(mat, rowwise_specs(operand))[1:2])
        values = torch.cat(row)
        key = (name, operand)
        if key in self._acc:  # a layer called twice: amax is the max, counts and energies add up
            prev = self._acc[key]
            values = torch.cat([torch.maximum(prev[:1], values[:1]), prev[1:] + values[1:]])
        self._acc[key] = values
        self._format[key] = "/".join(dict.fromkeys(_FORMATS.get(s.dtype, str(s.dtype)) for s in specs)) + (
            " tensorwise" if all(s.dim is None for s in specs) else " rowwise")

    def _on_input(self, name: str, module: nn.Module, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor):
            self._add(name, "input", module, seen_input(args[0]))
        if name not in self._weights and isinstance(module.weight, torch.Tensor):
            self._weights.add(name)
            self._add(name, "weight", module, module.weight)

    def _on_output(self, name: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda g: self._add(name, "grad_output", module, g))

    def table(self) -> dict[str, dict[str, dict[str, Any]]]:
        """``{layer: {operand: {format, amax, flush_fraction, saturated_fraction, sqnr_db, ...}}}`` (one host read)."""
        keys = list(self._acc)
        if not keys:
            return {}
        width = max(v.numel() for v in self._acc.values())
        pad = torch.nn.functional.pad
        rows = torch.stack([pad(self._acc[k], (0, width - self._acc[k].numel()), value=math.nan)
                            for k in keys]).cpu().tolist()
        out: dict[str, dict[str, dict[str, Any]]] = {n: {} for n, _ in self.layers}
        for (name, operand), row in zip(keys, rows):
            amax, flushed, nonzero, saturated, signal, noise, numel = row[:7]
            entry = {"format": self._format[(name, operand)], "amax": amax,
                     "flush_fraction": flushed / nonzero if nonzero else 0.0,
                     "saturated_fraction": saturated / numel if numel else 0.0, "sqnr_db": sqnr_db(signal, noise)}
            if len(row) > 7 and not math.isnan(row[7]):
                entry["rowwise_flush_fraction"] = row[7] / nonzero if nonzero else 0.0
            out[name][operand] = entry
        return {n: ops for n, ops in out.items() if ops}


def flush_findings(table: dict[str, dict[str, dict[str, Any]]], *, precision: PrecisionName, step: int | None) -> list[Finding]:
    """FP8_FLUSH per layer whose worst operand flushes beyond the band (or, failing any, the borderline ones)."""
    rule = THRESHOLDS["FP8_FLUSH"]
    worst = [(layer, *max(ops.items(), key=lambda kv: kv[1]["flush_fraction"])) for layer, ops in table.items()]
    flagged, borderline = rule.pick(worst, lambda row: row[2]["flush_fraction"])
    flagged.sort(key=lambda row: -row[2]["flush_fraction"])  # the worst layer first: the bisection tries it first
    findings = []
    for layer, operand, e in flagged[:8]:
        frac = e["flush_fraction"]
        rowwise = e.get("rowwise_flush_fraction")
        helps = rowwise is not None and rule.judge(rowwise) == "clear"
        finding = Finding(
            code="FP8_FLUSH", severity="warning", module=layer, step=step,
            message=(f"{frac:.1%} of the non-zero values of {display_module(layer)}'s {operand} flush to zero in its "
                     f"fp8 cast ({e['format']}, amax {e['amax']:.3g}): a few large values set the scale and the rest "
                     f"falls below fp8's smallest subnormal; the fp8 round trip of the {operand} is "
                     f"{e['sqnr_db']:.1f} dB SQNR" + (f", and fp8-rowwise would flush {rowwise:.1%}"
                                                         if rowwise is not None else "")),
            fix=fp8_filter_fix([layer], ("Or use 'fp8-rowwise', whose per-row scales keep these values; or"
                                         if helps else "Or") + " tame the outliers (a norm before the layer, a "
                               "smaller loss weight range).", precision=precision) + preflight_hint(precision),
            evidence={"operand": operand, **e, "operands": table[layer], "judgement": rule.evidence(frac)},
        )
        findings.append(as_borderline(finding, rule, frac) if borderline else finding)
    return findings


def operand_pass(session: Session, step: int | None) -> tuple[dict[str, dict[str, dict[str, Any]]], list[Finding]]:
    """The operand table of one untraced run of the session's step, and its FP8_FLUSH findings."""
    session.reset_work()
    with OperandProbe(session.work) as probe:
        run = session.run(session.work, mode="unit", stats=False)
    session.reset_work()
    if run.exception is not None:
        return {}, []
    table = probe.table()
    return table, flush_findings(table, precision=session.precision.name, step=step)
