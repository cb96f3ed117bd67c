"""The live doctor: ``ReplayDoctor``, the engine hook behind ``MixedPrecision(doctor=True)``."""

from __future__ import annotations

from ampkit.diagnose.live.doctor import ReplayDoctor

__all__ = ["ReplayDoctor"]
