"""The live doctor's own findings name the loss dtype as every other doctor's findings do."""

from __future__ import annotations

import torch
from torch import nn

from ampkit.diagnose.live.findings import loss_finding, seed_finding


def test_live_findings_seed_finding_names_one_loss_dtype_as_dtype_name_spells_it() -> None:
    model = nn.Linear(2, 2)
    finite = [torch.ones(2, dtype=torch.float16), torch.ones(2)]
    overflow = seed_finding(finite, model, step=3, scale=1024.0)  # finite losses, scaled: BACKWARD_OVERFLOW
    nan = seed_finding([torch.full((2,), float("nan"), dtype=torch.bfloat16)], model, step=3, scale=1.0)
    assert (overflow.code, nan.code) == ("BACKWARD_OVERFLOW", "FORWARD_NAN")
    assert (overflow.evidence["loss_dtype"], nan.evidence["loss_dtype"]) == ("fp16", "bf16")
    assert "loss_dtypes" not in overflow.evidence and "loss_dtypes" not in nan.evidence


def test_live_findings_loss_finding_only_for_a_low_precision_loss() -> None:
    assert loss_finding([torch.ones(())], step=1, scale=None) is None
    found = loss_finding([torch.ones(()), torch.ones((), dtype=torch.float16)], step=1, scale=1024.0)
    assert found is not None and found.code == "LOSS_IN_LOW_PRECISION"
    assert found.evidence == {"loss_dtype": "fp16", "loss_scale": 1024.0}
