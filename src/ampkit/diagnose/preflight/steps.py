"""The training steps preflight replays: a sample batch with its loss function, or a step captured from a script.

Both give the fp32 pass a step program (``diagnose.step.programs``) and the format replays a diagnosis:

* ``BatchStep``: ``loss_fn(model, batch)`` under the format's autocast, through ``diagnose_step``;
* ``CapturedStep``: the model call a training script made (``diagnose.capture.Capture``), replayed with
  the gradients its outputs received, through the one ``diagnose.replay.replay``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from ampkit.diagnose.capture import Capture
from ampkit.diagnose.preflight.fp32pass import LossFn
from ampkit.diagnose.replay import replay, replay_program
from ampkit.diagnose.step.api import diagnose_step
from ampkit.diagnose.step.programs import LossProgram, StepProgram
from ampkit.diagnose.step.result import DiagnosisResult
from ampkit.precision import Precision

__all__ = ["Autocast", "BatchStep", "CapturedStep", "PreflightStep", "shapes_of"]

Autocast = tuple[str, torch.dtype, bool]
"""(device type, dtype, enabled): the autocast a format runs the forward under."""


class PreflightStep(Protocol):
    """What preflight needs of one step."""

    def program(self) -> StepProgram:
        """The step as a program the fp32 pass runs (forward with ``fp32=True``, then backward)."""
        ...

    def diagnose(self, model: nn.Module, precision: Precision, autocast: Autocast, *, loss_scale: float | None,
                 bisect: bool, sqnr_threshold_db: float) -> DiagnosisResult:
        """The op-level diagnosis of the step on ``model`` (a prepared copy) under ``precision``."""
        ...

    def shapes(self) -> Any:
        """The shapes of the step's inputs, for the report."""
        ...


@dataclass(frozen=True)
class BatchStep:
    batch: Any
    loss_fn: LossFn

    def program(self) -> StepProgram:
        return LossProgram(lambda m: self.loss_fn(m, self.batch))

    def diagnose(self, model: nn.Module, precision: Precision, autocast: Autocast, *, loss_scale: float | None,
                 bisect: bool, sqnr_threshold_db: float) -> DiagnosisResult:
        device_type, dtype, enabled = autocast

        def run(m: nn.Module) -> torch.Tensor:
            with torch.autocast(device_type, dtype=dtype, enabled=enabled):
                return self.loss_fn(m, self.batch)

        return diagnose_step(model, run, precision=precision, loss_scale=loss_scale, bisect=bisect,
                             sqnr_threshold_db=sqnr_threshold_db)

    def shapes(self) -> Any:
        return shapes_of(self.batch)


@dataclass(frozen=True)
class CapturedStep:
    capture: Capture

    def program(self) -> StepProgram:
        return replay_program(self.capture)

    def diagnose(self, model: nn.Module, precision: Precision, autocast: Autocast, *, loss_scale: float | None,
                 bisect: bool, sqnr_threshold_db: float) -> DiagnosisResult:
        return replay(dataclasses.replace(self.capture, root=model), precision, autocast=autocast,
                      loss_scale=1.0 if loss_scale is None else loss_scale, bisect=bisect,
                      sqnr_threshold_db=sqnr_threshold_db)

    def shapes(self) -> Any:
        return {"args": shapes_of(list(self.capture.args)), "kwargs": shapes_of(dict(self.capture.kwargs))}


def shapes_of(value: Any) -> Any:
    """The shapes of the tensors in ``value``, nested as it is; a type name for anything else."""
    if isinstance(value, torch.Tensor):
        return list(value.shape)
    if isinstance(value, dict):
        return {str(k): shapes_of(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [shapes_of(v) for v in value]
    return type(value).__name__
