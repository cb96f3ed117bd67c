"""Host side of the step records: what is known about a row without reading the device, and the record dict.

``Telemetry`` writes each optimizer step into a device row (``metrics``); at a flush the rows
come back as lists of floats and ``make_record`` turns each into the documented record (see
docs/telemetry.md, "Records").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ampkit.telemetry.fp8stats import fp8_fields
from ampkit.telemetry.metrics import COL

__all__ = ["StepMeta", "current_rank", "floating_tensors", "make_record"]


@dataclass
class StepMeta:
    """Host-side facts of a row, known without reading the device."""

    step: int
    losses: int
    numel: int
    lr: float | None
    watched: bool
    module_slot: int | None = None
    module_names: list[str] | None = None
    module_present: list[int] | None = None
    fp8_slot: int | None = None
    fp8_layers: list[str] | None = None
    lr_tensor: torch.Tensor | None = None
    """A learning rate held as a tensor, until ``end_step`` copies it into the row."""


def make_record(meta: StepMeta, v: list[float], rank: int, tables: dict[str, list[list[float]]]) -> dict[str, Any]:
    """The record of one row ``v`` (``COLUMNS`` order) and its rows of the sampled ``tables``; a NaN
    gradient count (not measured) becomes None."""
    rec: dict[str, Any] = {
        "step": meta.step,
        "rank": rank,
        "loss": v[COL["loss_sum"]] / meta.losses if meta.losses else math.nan,
        # A float64 sum of fp32/bf16/fp16 values is inf/NaN exactly when one of them is.
        "loss_nonfinite": bool(meta.losses) and not math.isfinite(v[COL["loss_sum"]]),
        "scale": v[COL["scale"]],
        "next_scale": v[COL["next_scale"]],
        "skipped": v[COL["found_inf"]] > 0,
        "grad_norm": v[COL["grad_norm"]],
        "clip_coef": v[COL["clip_coef"]],
        "nonfinite_grads": None if math.isnan(v[COL["nonfinite_grads"]]) else int(v[COL["nonfinite_grads"]]),
        "zero_grad_fraction": None if math.isnan(v[COL["zero_grads"]]) else (
            v[COL["zero_grads"]] / meta.numel if meta.numel else math.nan),
        "lr": meta.lr if meta.lr is not None else v[COL["lr"]],
        "input_nonfinite": not math.isfinite(v[COL["input_bounds"]]) if meta.watched else None,
    }
    if meta.module_slot is not None and meta.module_names is not None and meta.module_present is not None:
        row = tables["modules"][meta.module_slot]
        rec["module_grad_absmax"] = {meta.module_names[j]: row[j] for j in meta.module_present}
    if meta.fp8_slot is not None and meta.fp8_layers is not None:
        rec.update(fp8_fields(meta.fp8_layers, tables["fp8"][meta.fp8_slot]))
    return rec


def current_rank() -> int:
    """``torch.distributed.get_rank()`` when a process group is initialised, else 0."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank())
    return 0


def floating_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """Floating tensors among the positional and keyword inputs, one container level deep."""
    found: list[torch.Tensor] = []
    for obj in (*args, *kwargs.values()):
        items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else (obj,)
        found.extend(t for t in items if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel())
    return found
