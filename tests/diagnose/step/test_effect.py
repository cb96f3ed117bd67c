"""PRECISION_LOSS judged by its effect on the model output: the module whose fp32 keeping restores it."""

from __future__ import annotations

import torch
from torch import nn

import ampkit
from ampkit.diagnose.step.api import diagnose_step
from ampkit.diagnose.step.compare import SQNR_THRESHOLD_DB, sqnr_db
from ampkit.diagnose.step.effect import fold_gradient_twin
from ampkit.findings import Finding
from diagnose import doctor_models as dm


class Center(nn.Module):
    """Subtracts the per-row mean: exact in fp32, it exposes any rounding of a large common offset."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h - h.mean(dim=-1, keepdim=True)


class OffsetNet(nn.Module):
    """``proj`` outputs ~300 + small differences: fine by its own SQNR, useless once centred in bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.center = Center()
        self.head = nn.Linear(8, 2)
        with torch.no_grad():
            self.proj.weight.copy_(0.25 * torch.eye(8))
            self.proj.bias.fill_(300.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.center(self.proj(x)))


@torch.no_grad()
def _output_sqnr(model: nn.Module, keep: list[str], x: torch.Tensor) -> float:
    """The model output's SQNR against fp32 when trained by the engine with ``keep_fp32=keep``."""
    ref = model(x)
    mp = ampkit.MixedPrecision("bf16", device="cpu", keep_fp32=keep)
    mp.prepare(model)
    with mp.autocast():
        out = model(x).float()
    return sqnr_db(float(ref.pow(2).sum()), float((ref - out).pow(2).sum()))


def test_effect_precision_loss_names_the_module_whose_fp32_keeping_restores_the_output() -> None:
    x = torch.randn(16, 8)
    result = diagnose_step(OffsetNet(), dm.bf16_run(x), precision="bf16")
    (f,) = [f for f in result.findings if f.code == "PRECISION_LOSS" and f.evidence.get("kind") == "activation"]
    assert f.module == "proj"  # the producer, not "center" where the loss first shows
    assert f.evidence["first_below_threshold"] == "center"
    assert f.evidence["module_sqnr_db"] > SQNR_THRESHOLD_DB
    assert f.evidence["output_sqnr_db_before"] < SQNR_THRESHOLD_DB <= f.evidence["output_sqnr_db_after"]
    assert result.keep_fp32 == ["proj"] and f.fix.startswith("Verified fix")
    # Independently, through the engine: keeping proj in fp32 restores the output, keeping center does not.
    assert _output_sqnr(OffsetNet(), ["proj"], x) > SQNR_THRESHOLD_DB
    assert _output_sqnr(OffsetNet(), ["center"], x) < SQNR_THRESHOLD_DB


def test_effect_scan_trials_each_candidate_alone_and_a_single_fix_needs_no_grow_trial() -> None:
    result = diagnose_step(OffsetNet(), dm.bf16_run(torch.randn(16, 8)), precision="bf16")
    bisection = result.bisection
    assert set(bisection["effects"]) == {"proj", "center", "head"}
    # all of them together first (the most any subset restores: here it fixes the step), then each alone
    assert [t["keep_fp32"] for t in bisection["trials"]] == [["proj", "center", "head"], ["proj"], ["center"], ["head"]]
    assert bisection["culprit"] == "proj" and bisection["verification"]["verified"]


def test_effect_without_bisection_keeps_the_first_module_below_the_threshold() -> None:
    result = diagnose_step(OffsetNet(), dm.bf16_run(torch.randn(16, 8)), precision="bf16", bisect=False)
    (f,) = [f for f in result.findings if f.code == "PRECISION_LOSS" and f.evidence.get("kind") == "activation"]
    assert f.module == "center" and "judged_by" not in f.evidence


def test_effect_fold_gradient_twin_keeps_one_finding_per_module() -> None:
    named = Finding(code="PRECISION_LOSS", severity="warning", message="a", fix="f", module="proj",
                    evidence={"kind": "activation"})
    twin = Finding(code="PRECISION_LOSS", severity="warning", message="g", fix="f", module="proj",
                   evidence={"kind": "gradient", "sqnr_db": -3.0, "global_sqnr_db": 5.0})
    other = Finding(code="PRECISION_LOSS", severity="warning", message="g", fix="f", module="head",
                    evidence={"kind": "gradient", "sqnr_db": 1.0})
    (folded, kept) = fold_gradient_twin([named, twin, other], named)
    assert folded.message == "a" and folded.evidence["gradient_sqnr_db"] == -3.0
    assert kept is other


def _conv_bn_relu() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """Three conv/BatchNorm/ReLU blocks in bf16: the gradient of the middle BatchNorm ('1.1') is far below 20 dB."""
    torch.manual_seed(0)

    def block(i: int, o: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU())

    model = nn.Sequential(block(3, 8), block(8, 8), block(8, 8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    return model, torch.randn(4, 3, 16, 16), torch.randint(0, 4, (4,))


def _gradient_loss(bisect: bool) -> Finding:
    model, x, y = _conv_bn_relu()

    def run(m: nn.Module) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return nn.functional.cross_entropy(m(x).float(), y)

    result = diagnose_step(model, run, precision="bf16", bisect=bisect)
    (f,) = [f for f in result.findings if f.code == "PRECISION_LOSS" and f.evidence.get("kind") == "gradient"]
    return f


def test_effect_gradient_precision_loss_fix_that_fails_is_not_offered() -> None:
    f = _gradient_loss(bisect=True)
    assert f.module == "1.1" and f.evidence["fix_verified"] is False
    tried = f.evidence["fix_tried"]
    assert tried[0]["keep_fp32"] == ["1.1"] and tried[0]["gradient_sqnr_db"] < SQNR_THRESHOLD_DB
    assert f.evidence["fix_sqnr_db"] == max(t["gradient_sqnr_db"] for t in tried)
    assert "did not help" in f.fix and "keep_fp32=['1.1'] leaves it at" in f.fix
    assert not f.fix.startswith("Keep '1.1' in fp32")


def test_effect_gradient_precision_loss_fix_without_bisection_says_it_is_not_verified() -> None:
    f = _gradient_loss(bisect=False)
    assert f.evidence["fix_verified"] is False and "fix_sqnr_db" not in f.evidence
    assert f.fix.startswith("Not verified (this step was not re-run with it")
