"""Diagnostics: where and why low precision breaks, and what to change.

The tree is one sub-package per mode over a shared core:

* ``capture.py`` and ``replay.py``: the one record of a forward (``Capture``, filled by ``CaptureHooks``)
  and the one replay of it under a precision, with the fp32 shadow and the bisection; every doctor
  produces captures and replays them through these two;
* ``core/``: what every doctor shares (tensor statistics, module attribution, finding display);
* ``step/``: the step doctor, ``diagnose_step`` (op tracing, FP32 shadow, keep-fp32 bisection);
* ``script/``: ``ampkit doctor SCRIPT`` (runner, watchers/, end-of-run rules, error explanations);
* ``live/``: ``ReplayDoctor``, the engine hook of ``MixedPrecision(doctor=True)``;
* ``report/``: terminal, JSON and HTML output; ``task.py``: ``diagnose_task``.

The public entry points are imported lazily, so ``import ampkit.findings`` stays cheap:

* ``diagnose_step(model, run, precision=...)`` -> ``DiagnosisResult`` (``ampkit.diagnose.step``)
* ``diagnose_task(task, precision)`` (``ampkit.diagnose.task``)
* ``tensor_stats(t)`` -> ``TensorStats`` (``ampkit.diagnose.core.stats``)
* ``ReplayDoctor`` (``ampkit.diagnose.live``)
* ``render_terminal``, ``write_json``, ``write_html`` (``ampkit.diagnose.report``)
"""

from __future__ import annotations

from ampkit._util.lazy import lazy_attributes

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

__getattr__, __dir__ = lazy_attributes(__name__, {
    "DiagnosisResult": "ampkit.diagnose.step.result",
    "diagnose_step": "ampkit.diagnose.step.api",
    "diagnose_task": "ampkit.diagnose.task",
    "TensorStats": "ampkit.diagnose.core.stats",
    "tensor_stats": "ampkit.diagnose.core.stats",
    "ReplayDoctor": "ampkit.diagnose.live.doctor",
    "render_terminal": "ampkit.diagnose.report.terminal",
    "write_json": "ampkit.diagnose.report.json",
    "write_html": "ampkit.diagnose.report.html",
})
