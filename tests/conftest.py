from __future__ import annotations

import os
import random
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

TESTS = Path(__file__).resolve().parent
BENCHMARKS = TESTS.parent / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    # The GPU check's modules (gpucheck) and the benchmark scripts live in benchmarks/, not in an
    # installed package; the GPU check's tests and the fp8 recipe test import them from there.
    sys.path.insert(0, str(BENCHMARKS))


def _inductor_cache_per_isa() -> None:
    """Give the suite's torch.compile calls a cache directory of their own per kernel cap.

    inductor's cache key does not include ``ATEN_CPU_CAPABILITY`` / ``ONEDNN_MAX_CPU_ISA``: a kernel
    compiled for AVX-512 is loaded by the emulated AVX2 run (and the reverse), which then fails or
    aborts.  Set before any compile; rank and worker subprocesses inherit it.
    """
    caps = [f"{k}={os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if os.environ.get(k)]
    slug = re.sub(r"[^A-Za-z0-9=_-]", "_", "-".join(caps) or "native")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                          str(Path(tempfile.gettempdir()) / f"ampkit-tests-inductor-{os.getuid()}-{slug}"))


_inductor_cache_per_isa()
NUMERICS = (
    "diagnose/", "telemetry/", "verify/", "tasks/", "cli/test_doctor.py", "cli/test_verify.py",
    "integrations/test_doctor_frameworks.py", "bench/test_gpu_check_sections.py", "bench/test_gpu_check_fp8.py",
    "test_engine", "test_scaler.py", "test_precision.py", "test_policy.py", "test_env.py", "test_mixed_precision.py",
    "test_checkpoint.py", "test_compile.py", "test_thresholds.py", "_util/test_isa.py",
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
