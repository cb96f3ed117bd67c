"""``make_telemetry``: the one resolver of the ``telemetry=`` shorthand.

``MixedPrecision(telemetry=spec)`` and ``ampkit.telemetry.observe(..., telemetry=spec)`` (and the
framework integrations built on it) accept the same forms: a ``Telemetry``, a list of sinks (or
callables), a single sink, a ``*.jsonl`` path, or ``True`` (alarms only, no sink).

>>> make_telemetry("run.txt", where="observe")
Traceback (most recent call last):
...
ValueError: observe(telemetry='run.txt'): a path must end in .jsonl (one record per line); for TensorBoard pass telemetry=[ampkit.TensorBoardSink(log_dir)]
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ampkit.telemetry.core import Telemetry
from ampkit.telemetry.sinks import JsonlSink, Sink

if TYPE_CHECKING:
    from ampkit.engine import Engine

__all__ = ["make_telemetry"]


def make_telemetry(spec: Any, engine: Engine | None = None, *, where: str = "MixedPrecision") -> Telemetry:
    """Build (or take) the ``Telemetry`` for ``telemetry=spec``; attach it to ``engine`` if given.

    ``where`` names the call in error messages (``MixedPrecision``, ``observe``, ``AmpkitCallback``).
    """
    if isinstance(spec, Telemetry):
        telemetry = spec
    elif spec is True:
        telemetry = Telemetry()
    elif isinstance(spec, (str, os.PathLike)):
        if not os.fspath(spec).endswith(".jsonl"):
            raise ValueError(
                f"{where}(telemetry={os.fspath(spec)!r}): a path must end in .jsonl (one record per line); "
                "for TensorBoard pass telemetry=[ampkit.TensorBoardSink(log_dir)]"
            )
        telemetry = Telemetry(sinks=[JsonlSink(spec)])
    elif isinstance(spec, Sink):
        telemetry = Telemetry(sinks=[spec])
    elif isinstance(spec, (list, tuple)):
        telemetry = Telemetry(sinks=spec)
    else:
        raise TypeError(
            f"{where}(telemetry={spec!r}): use a Telemetry(...), a list of sinks "
            "([JsonlSink(path), TensorBoardSink(dir), ProgressSink(), CallbackSink(fn)]), a '*.jsonl' path, or True"
        )
    if engine is not None and telemetry not in engine.hooks:
        engine.add_hook(telemetry)
    return telemetry
