"""Fixtures of the doctor tests: a fixed seed for every test."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def seed() -> int:
    torch.manual_seed(0)
    return 0
