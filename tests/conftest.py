from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

TESTS = Path(__file__).resolve().parent
NUMERICS = (
    "diagnose/", "telemetry/", "verify/", "tasks/", "cli/test_doctor.py", "cli/test_verify.py",
    "integrations/test_doctor_frameworks.py", "bench/test_gpu_check_sections.py", "test_engine", "test_scaler.py",
    "test_precision.py", "test_policy.py", "test_env.py", "test_mixed_precision.py", "test_checkpoint.py",
    "test_compile.py", "test_thresholds.py", "_util/test_isa.py",
)
"""Tests (path prefixes under tests/) that judge numbers the CPU's kernels decide: precision, SQNR,
overflow, bit-exactness against the recipe, speed ratios and verdicts.  They carry the ``numerics``
marker, and `make test-avx2` runs them again on an emulated AVX2-only CPU."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.fspath)).resolve()
        if path.is_relative_to(TESTS) and path.relative_to(TESTS).as_posix().startswith(NUMERICS):
            item.add_marker(pytest.mark.numerics)


@pytest.fixture
def seed() -> int:
    """Seed every RNG the tests touch; returns the seed."""
    value = 1234
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)
    return value
