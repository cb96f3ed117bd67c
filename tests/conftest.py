from __future__ import annotations

import random

import numpy as np
import pytest
import torch


@pytest.fixture
def seed() -> int:
    """Seed every RNG the tests touch; returns the seed."""
    value = 1234
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)
    return value
