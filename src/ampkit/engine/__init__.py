"""The engine: autocast, loss scaling and the documented step order (``Engine``), and its configuration.

The public face of the package; its private modules are the engine's satellites: ``config``
(``EngineConfig``), ``_guards`` (construction-time checks), ``_boundary`` (the work per optimizer
at an accumulation boundary) and ``_state`` (the check of a saved engine state).  Users train with
``ampkit.MixedPrecision``, which is ``Engine`` plus the ``telemetry=`` and ``doctor=`` shorthands.
"""

from __future__ import annotations

from ampkit.engine.config import EngineConfig
from ampkit.engine.engine import Engine

__all__ = ["Engine", "EngineConfig"]
