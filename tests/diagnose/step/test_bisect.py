"""Bisection: the minimal keep-fp32 set, verified by re-running the step with it."""

from __future__ import annotations

import copy

import torch
from torch import nn

import ampkit
from ampkit.diagnose.step.api import diagnose_step
from diagnose import doctor_models as dm


def _loss_with(model: nn.Module, keep: list[str], x: torch.Tensor) -> torch.Tensor:
    mp = ampkit.MixedPrecision("fp16", device="cpu", keep_fp32=keep)
    mp.prepare(model)
    with mp.autocast():
        return model(x).float().pow(2).mean()


def test_bisect_finds_the_single_norm_and_the_fix_verifies() -> None:
    model = dm.NormNet(n=3, hot=(1,))
    x = torch.randn(4, 16) * 3
    result = diagnose_step(model, dm.fp16_run(x), precision="fp16")
    assert result.keep_fp32 == ["blocks.1.norm"]
    verification = result.bisection["verification"]
    assert verification["verified"] and verification["finite"]
    assert verification["output_sqnr_db"] > 20
    (f,) = [f for f in result.findings if f.code == "FORWARD_OVERFLOW"]
    assert f.evidence["verified_fix"]["keep_fp32"] == ["blocks.1.norm"]
    assert f.fix.startswith("Verified fix: MixedPrecision(..., keep_fp32=['blocks.1.norm'])")
    # Independently: the engine with that keep_fp32 gives the fp32 answer; without it, it does not.
    ref = model(x).pow(2).mean()
    assert torch.allclose(_loss_with(copy.deepcopy(model), ["blocks.1.norm"], x), ref, rtol=1e-2)
    assert not torch.allclose(_loss_with(copy.deepcopy(model), [], x), ref, rtol=1e-2)


def test_bisect_repeated_blocks_collapse_to_a_pattern() -> None:
    model = dm.NormNet(n=2, hot=(0, 1))
    result = diagnose_step(model, dm.fp16_run(torch.randn(4, 16) * 3), precision="fp16")
    assert result.keep_fp32 == ["blocks.*.norm"]
    assert result.bisection["verification"]["modules"] == ["blocks.0.norm", "blocks.1.norm"]


class TwoStage(nn.Module):
    """fc1's output (~1e5) overflows fp16; kept in fp32 it still overflows fc2's input cast."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)
        with torch.no_grad():
            self.fc1.weight.fill_(3e4)
            self.fc2.weight.fill_(1e-5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc2(self.fc1(x)))


def test_bisect_follows_the_overflow_when_it_moves() -> None:
    result = diagnose_step(TwoStage(), dm.fp16_run(torch.ones(2, 4)), precision="fp16")
    assert result.keep_fp32 == ["fc1", "fc2"]
    trials = result.bisection["trials"]
    assert trials[0]["keep_fp32"] == ["fc1"] and not trials[0]["fixed"]
    assert trials[0]["next"] == "fc2"  # the cast into fc2 now overflows: that names the next module
    assert result.bisection["verification"]["verified"]


def test_bisect_fixes_precision_loss() -> None:
    from diagnose.step.test_compare import CancelNet

    result = diagnose_step(CancelNet(), dm.bf16_run(torch.randn(16, 8)), precision="bf16")
    assert result.keep_fp32 == ["cancel"]
    assert result.bisection["verification"]["module_sqnr_db"]["cancel"] > 20


def test_bisect_not_attempted_for_data_problems() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    x = torch.randn(3, 4)
    x[0, 0] = float("nan")
    result = diagnose_step(model, dm.bf16_run(x), precision="bf16")
    assert result.keep_fp32 is None and result.bisection is None
