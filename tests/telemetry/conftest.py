"""Fixtures shared by the telemetry tests."""

from __future__ import annotations

import pytest
import torch
from telemetry_helpers import TinyRegressor


@pytest.fixture(autouse=True)
def seed() -> int:
    torch.manual_seed(0)
    return 0


@pytest.fixture
def tiny() -> TinyRegressor:
    return TinyRegressor()
