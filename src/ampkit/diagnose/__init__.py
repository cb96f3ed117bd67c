"""Diagnostics: where and why low precision breaks, and what to change.

The public entry points are imported lazily, so ``import ampkit.findings`` stays cheap:

* ``diagnose_step(model, run, precision=...)`` -> ``DiagnosisResult`` (``ampkit.diagnose.api``)
* ``diagnose_task(task, precision)`` (``ampkit.diagnose.task``)
* ``tensor_stats(t)`` -> ``TensorStats`` (``ampkit.diagnose.stats``)
* ``ReplayDoctor`` — what ``MixedPrecision(doctor=True)`` installs (``ampkit.diagnose.replay``)
* ``render_terminal``, ``write_json``, ``write_html`` (``ampkit.diagnose.output``)
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "DiagnosisResult",
    "ReplayDoctor",
    "TensorStats",
    "diagnose_step",
    "diagnose_task",
    "render_terminal",
    "tensor_stats",
    "write_html",
    "write_json",
]

_HOME = {
    "DiagnosisResult": "api", "diagnose_step": "api", "diagnose_task": "task", "TensorStats": "stats",
    "tensor_stats": "stats", "ReplayDoctor": "replay", "render_terminal": "output", "write_json": "output",
    "write_html": "output",
}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f"ampkit.diagnose.{_HOME[name]}"), name)
    raise AttributeError(f"module 'ampkit.diagnose' has no attribute {name!r}")
