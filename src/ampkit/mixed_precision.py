"""``MixedPrecision``: the public engine, with the ``telemetry=`` and ``doctor=`` shorthands.

``ampkit.MixedPrecision`` is ``ampkit.engine.Engine`` plus two documented shorthands, which
this module resolves into hooks (the engine itself knows only hooks):

* ``telemetry=``: a ``Telemetry``, a list of sinks, a single sink, a ``*.jsonl`` path or
  ``True`` (``ampkit.telemetry.make_telemetry``'s rules); exposed as ``.telemetry``;
* ``doctor=True``: a ``ReplayDoctor`` that replays a failing step fully instrumented;
  exposed as ``.doctor``.

Both are None when off.  ``MixedPrecision(..., hooks=[Telemetry(...)])`` is the general form:
the shorthands only build the hooks and attach them after ``hooks=``, in that order.

>>> import torch
>>> mp = MixedPrecision("bf16", device="cpu", telemetry=True)
>>> type(mp.telemetry).__name__, mp.doctor, mp.telemetry in mp.hooks
('Telemetry', None, True)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ampkit.diagnose.live import ReplayDoctor
from ampkit.engine import Engine
from ampkit.fp8 import Fp8Filter
from ampkit.hooks import EngineHook
from ampkit.policy import KeepFp32Rule
from ampkit.precision import Precision
from ampkit.scaler import LossScaler
from ampkit.telemetry import Telemetry, make_telemetry

__all__ = ["MixedPrecision"]


class MixedPrecision(Engine):
    """Mixed-precision training engine (see ``Engine`` for the step order and the arguments).

    Args:
        precision, device, scaler, grad_accumulation, clip_grad_norm, keep_fp32,
        skip_nonfinite, hooks: as for ``Engine``.
        telemetry: on-device step metrics and alarms (see ``ampkit.telemetry``).
        doctor: keep a cheap capture of each step and replay a failing one fully instrumented
            (see ``ampkit.diagnose.live``).

    Example: the loop of ``Engine``, with step metrics recorded in a list::

    >>> import ampkit, torch
    >>> records = []
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> mp = ampkit.MixedPrecision("bf16", device="cpu", telemetry=[records.append])
    >>> _ = mp.prepare(model)
    >>> with mp.autocast():
    ...     loss = model(torch.randn(8, 4)).float().pow(2).mean()
    >>> mp.backward(loss)
    >>> _ = mp.step(opt)
    >>> mp.close()
    >>> [r["step"] for r in records], mp.doctor is None
    ([1], True)
    """

    def __init__(
        self,
        precision: str | Precision = "auto",
        *,
        device: str | torch.device | None = "auto",
        scaler: LossScaler | str | None = None,
        grad_accumulation: int = 1,
        clip_grad_norm: float | None = None,
        keep_fp32: Sequence[KeepFp32Rule] | None = (),
        skip_nonfinite: bool = True,
        hooks: Sequence[EngineHook] | None = (),
        fp8_filter: Fp8Filter = None,
        telemetry: Any = None,
        doctor: bool = False,
    ) -> None:
        # Spelled out (not ``**engine``) so type checkers and IDEs see every argument; a test checks
        # that this list and Engine's stay the same.
        super().__init__(precision, device=device, scaler=scaler, grad_accumulation=grad_accumulation,
                         clip_grad_norm=clip_grad_norm, keep_fp32=keep_fp32, skip_nonfinite=skip_nonfinite,
                         hooks=hooks, fp8_filter=fp8_filter)
        self.telemetry: Telemetry | None = None
        """The ``Telemetry`` hook built from ``telemetry=`` (None when off)."""
        self.doctor: ReplayDoctor | None = None
        """The ``ReplayDoctor`` hook of ``doctor=True`` (None when off)."""
        if telemetry is not None:
            self.telemetry = make_telemetry(telemetry, self)
        if doctor:
            self.doctor = ReplayDoctor()
            self.add_hook(self.doctor)
