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


class OffsetBranch(nn.Module):
    """``fc(x) - 256``: fc's output sits at 256, where bf16's spacing is 2, so the branch's rounding
    error is about as large as its signal."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        with torch.no_grad():
            self.fc.weight.mul_(0.3)
            self.fc.bias.fill_(256.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) - 256.0


class Branches(nn.Module):
    """The sum of ``n`` offset branches of the same input: n independent errors of one size, so one
    branch kept in fp32 removes 1/n of the error energy, 10*log10(n / (n - 1)) dB."""

    def __init__(self, n: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.branches = nn.ModuleList(OffsetBranch(8) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((b(x) for b in self.branches), torch.zeros(()))


def test_bisect_stops_after_one_trial_when_all_scanned_together_gain_under_the_culprit_bar() -> None:
    # 64 branches: the 16 scanned modules kept in fp32 together leave most branches' error, so the
    # output gains about 1 dB, under CULPRIT_GAIN_DB: no subset of them fixes the step and none alone
    # can be named, so the search stops after that one trial (no single-module scan, no grow).
    from ampkit.diagnose.step.bisect import CULPRIT_GAIN_DB, EFFECT_SCAN_LIMIT

    result = diagnose_step(Branches(64), dm.bf16_run(torch.randn(16, 8)), precision="bf16")
    bisection = result.bisection
    assert result.keep_fp32 is None
    assert bisection["reason"].startswith("spread: the") and "effects" not in bisection
    assert 0 < bisection["spread_gain_db"] < CULPRIT_GAIN_DB
    assert bisection["spread_modules"] == EFFECT_SCAN_LIMIT
    (together,) = bisection["trials"]
    assert len(together["keep_fp32"]) == EFFECT_SCAN_LIMIT and not together["fixed"]
    (loss,) = [f for f in result.findings if f.code == "PRECISION_LOSS" and f.evidence["kind"] == "activation"]
    assert loss.evidence["judged_by"] == "spread" and loss.evidence["tried_together"] == EFFECT_SCAN_LIMIT
    assert loss.fix.startswith(f"No small keep_fp32 list restores it: the {EFFECT_SCAN_LIMIT} modules tried")


def test_bisect_stops_at_a_loss_spread_over_more_branches_than_it_scans() -> None:
    # 24 branches: all 16 scanned modules together gain over CULPRIT_GAIN_DB without fixing the
    # step, so each is tried alone; one branch in fp32 gains 0.2 dB, under NO_EFFECT_DB: spread.
    from ampkit.diagnose.step.bisect import CULPRIT_GAIN_DB, EFFECT_SCAN_LIMIT, NO_EFFECT_DB

    result = diagnose_step(Branches(24), dm.bf16_run(torch.randn(16, 8)), precision="bf16")
    bisection = result.bisection
    assert result.keep_fp32 is None
    assert bisection["culprit"] is None and bisection["reason"].startswith("spread: no module")
    assert bisection["spread_gain_db"] >= CULPRIT_GAIN_DB
    scanned = len(bisection["effects"])
    assert scanned == EFFECT_SCAN_LIMIT
    assert len(bisection["trials"]) == 1 + scanned  # all of them together, then each alone: no grow
    together = bisection["trials"][0]
    assert sorted(together["keep_fp32"]) == sorted(bisection["effects"]) and not together["fixed"]
    assert max(bisection["effects"][m][""] for m in bisection["effects"]) - result.comparison["output_sqnr_db"][""] \
        < NO_EFFECT_DB
    (loss,) = [f for f in result.findings if f.code == "PRECISION_LOSS" and f.evidence["kind"] == "activation"]
    assert loss.evidence["judged_by"] == "spread" and set(loss.evidence["effects"]) == set(bisection["effects"])


def test_bisect_keeps_searching_when_all_scanned_branches_together_fix_the_step() -> None:
    # 8 branches: each alone gains 0.6 dB, under NO_EFFECT_DB, yet all kept in fp32 restore the
    # output, so the search must go on to the real fix (every branch's fc in fp32).
    result = diagnose_step(Branches(8), dm.bf16_run(torch.randn(16, 8)), precision="bf16")
    bisection = result.bisection
    assert max(bisection["effects"][m][""] for m in bisection["effects"]) - result.comparison["output_sqnr_db"][""] < 1.0
    assert bisection.get("spread_gain_db") is None
    assert result.keep_fp32 is not None and bisection["verification"]["verified"]


class _OwnPositions(nn.Module):
    """Sinusoids of positions built in the dtype of its child's output: bf16 rounds positions above 256."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        pos = torch.arange(x.shape[0], dtype=h.dtype)[:, None] * torch.ones(8, dtype=h.dtype)
        return h + pos.sin()


class _ChildPhase(nn.Module):
    """Sinusoids of phases its child computes: the child's bf16 output rounds them (the child loses it)."""

    def __init__(self) -> None:
        super().__init__()
        self.freq = nn.Linear(1, 8, bias=False)
        with torch.no_grad():
            self.freq.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.freq(x[:, :1] * 0 + torch.arange(x.shape[0], dtype=torch.float32)[:, None]).sin()


def test_bisect_names_the_parent_whose_own_ops_lose_the_precision_not_its_child() -> None:
    model = nn.Sequential(_OwnPositions(), nn.Linear(8, 4))
    result = diagnose_step(model, dm.bf16_run(torch.randn(1024, 8) * 0.1), precision="bf16")
    (finding,) = [f for f in result.findings if f.code == "PRECISION_LOSS" and f.evidence.get("judged_by")]
    assert finding.module == "0"  # keeping 0.proj in fp32 fixes it too, only by making the positions fp32


def test_bisect_keeps_the_child_whose_rounded_output_the_parent_needs() -> None:
    model = nn.Sequential(_ChildPhase(), nn.Linear(8, 4))
    result = diagnose_step(model, dm.bf16_run(torch.randn(1024, 8)), precision="bf16")
    (finding,) = [f for f in result.findings if f.code == "PRECISION_LOSS" and f.evidence.get("judged_by")]
    assert finding.module == "0.freq"
