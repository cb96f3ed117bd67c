"""Fixtures shared by the telemetry tests."""

from __future__ import annotations

import pytest

from .telemetry_helpers import TinyRegressor


@pytest.fixture(autouse=True)
def _seeded(seed: int) -> int:
    """Every telemetry test runs seeded (the suite's ``seed`` fixture)."""
    return seed


@pytest.fixture
def tiny() -> TinyRegressor:
    return TinyRegressor()
