"""Per-step training records kept on the device and read back once, at the end of a run.

``StepRecorder`` is an ``EngineHook``: ``on_backward`` adds the (unscaled, undivided) loss to an
on-device sum, ``after_step`` stacks one row ``[loss, found_inf, scale, grad_norm]`` per
optimizer boundary.  Nothing is read on the host until ``records()``: one device-to-host copy
for the whole run.  The records have the keys of ``ampkit.telemetry``'s step records
(``step``, ``loss``, ``loss_nonfinite``, ``scale``, ``skipped``, ``grad_norm``), so either can
feed the verify report.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ampkit.engine import EngineHook, MixedPrecision, StepResult

__all__ = ["RECORD_KEYS", "StepRecorder"]

RECORD_KEYS = ("step", "loss", "loss_nonfinite", "scale", "skipped", "grad_norm")


class StepRecorder(EngineHook):
    """Collect one record per optimizer step without a host sync.

    ``step`` counts optimizer steps from 1, as ``ampkit.telemetry`` does (record ``i`` is
    ``loss[i]`` of the run, step ``i + 1``); ``loss`` is the mean of the losses passed to
    ``mp.backward`` since the previous boundary.

    >>> import ampkit
    >>> rec = StepRecorder()
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> mp = ampkit.MixedPrecision("fp32", device="cpu", hooks=[rec])
    >>> for _ in range(2):
    ...     mp.backward(model(torch.ones(1, 2)).sum() * 0 + 3.0)
    ...     _ = mp.step(opt)
    >>> [(r["step"], r["loss"], r["skipped"]) for r in rec.records()]
    [(1, 3.0, False), (2, 3.0, False)]
    """

    def __init__(self) -> None:
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self._rows: list[torch.Tensor] = []

    def on_backward(self, engine: MixedPrecision, loss: torch.Tensor) -> None:
        value = loss.detach().to(torch.float32)
        self._loss_sum = value.clone() if self._loss_sum is None else self._loss_sum + value
        self._loss_count += 1

    def after_step(self, engine: MixedPrecision, result: StepResult,
                   optimizers: Sequence[torch.optim.Optimizer]) -> None:
        device = engine.device
        nan = torch.full((), math.nan, dtype=torch.float32, device=device)
        loss = self._loss_sum / self._loss_count if self._loss_sum is not None else nan
        found_inf = result.found_inf if result.found_inf is not None else torch.zeros((), device=device)
        scale = result.scale if result.scale is not None else torch.ones((), device=device)
        grad_norm = result.grad_norm if result.grad_norm is not None else nan
        row = torch.stack([t.to(device=device, dtype=torch.float32).reshape(()) for t in
                           (loss, found_inf, scale, grad_norm)])
        self._rows.append(row)
        self._loss_sum, self._loss_count = None, 0

    def __len__(self) -> int:
        return len(self._rows)

    def recent_losses(self, count: int) -> list[float]:
        """The last ``count`` step losses (a host sync: call it at evaluation points only)."""
        if not self._rows:
            return []
        return torch.stack([row[0] for row in self._rows[-count:]]).cpu().tolist()

    def records(self) -> list[dict[str, Any]]:
        """The records so far as plain Python values (one host sync for all of them)."""
        if not self._rows:
            return []
        table = torch.stack(self._rows).cpu().tolist()
        return [
            {
                "step": i + 1,
                "loss": loss,
                "loss_nonfinite": not math.isfinite(loss),
                "scale": scale,
                "skipped": found_inf > 0,
                "grad_norm": grad_norm,
            }
            for i, (loss, found_inf, scale, grad_norm) in enumerate(table)
        ]
