"""A diagnosed overflow shared by the report tests."""

from __future__ import annotations

import pytest
import torch

from ampkit.diagnose.step.api import diagnose_step
from ampkit.diagnose.step.result import DiagnosisResult
from diagnose import doctor_models as dm


@pytest.fixture(scope="module")
def overflow_result() -> DiagnosisResult:
    torch.manual_seed(0)
    return diagnose_step(dm.NormNet(hot=(1,)), dm.fp16_run(torch.randn(4, 16) * 3), precision="fp16")
