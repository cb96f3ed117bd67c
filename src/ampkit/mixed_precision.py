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

import inspect
from typing import Any

from ampkit.diagnose.live import ReplayDoctor
from ampkit.engine import Engine
from ampkit.precision import Precision
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
        self, precision: str | Precision = "auto", *, telemetry: Any = None, doctor: bool = False, **engine: Any,
    ) -> None:
        super().__init__(precision, **engine)
        self.telemetry: Telemetry | None = None
        """The ``Telemetry`` hook built from ``telemetry=`` (None when off)."""
        self.doctor: ReplayDoctor | None = None
        """The ``ReplayDoctor`` hook of ``doctor=True`` (None when off)."""
        if telemetry is not None:
            self.telemetry = make_telemetry(telemetry, self)
        if doctor:
            self.doctor = ReplayDoctor()
            self.add_hook(self.doctor)


def _public_signature() -> inspect.Signature:
    # ``**engine`` keeps the argument list in one place (Engine); this shows the full list to
    # help(), IDEs and inspect.signature instead of an opaque ``**engine``.
    engine = inspect.signature(Engine.__init__).parameters
    own = inspect.signature(MixedPrecision.__init__).parameters
    params = [*engine.values(), own["telemetry"], own["doctor"]]
    return inspect.signature(MixedPrecision.__init__).replace(parameters=params)


MixedPrecision.__init__.__signature__ = _public_signature()  # type: ignore[attr-defined]
