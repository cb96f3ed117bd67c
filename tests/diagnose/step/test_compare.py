"""FP32 shadow: SQNR per module, PRECISION_LOSS, GRADIENT_UNDERFLOW."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ampkit.diagnose.step.api import diagnose_step
from ampkit.diagnose.step.compare import SQNR_THRESHOLD_DB, compare_grads, flush_bound, sqnr_db
from ampkit.tasks.gpt import GPT, GPTConfig
from diagnose import doctor_models as dm


class Cancel(nn.Module):
    """(x + 1000) - 1000: exact in fp32, but bf16's 8-bit mantissa keeps nothing of a small x."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + 1000.0) - 1000.0


class CancelNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.cancel = Cancel()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.cancel(self.lin(x)))


def test_compare_sqnr_db_definition() -> None:
    assert sqnr_db(1.0, 0.01) == pytest.approx(20.0)
    assert sqnr_db(4.0, 4.0) == pytest.approx(0.0)
    assert sqnr_db(1.0, 0.0) == math.inf
    assert math.isnan(sqnr_db(0.0, 1.0))


def test_compare_precision_loss_names_the_cancelling_module() -> None:
    result = diagnose_step(CancelNet(), dm.bf16_run(torch.randn(16, 8)), precision="bf16", bisect=False)
    (f,) = [f for f in result.findings if f.code == "PRECISION_LOSS" and f.evidence["kind"] == "activation"]
    assert f.module == "cancel"  # the first module below the threshold, not "head" after it
    assert "`ampkit preflight --precision bf16 TARGET`" in f.fix
    assert f.evidence["sqnr_db"] < SQNR_THRESHOLD_DB
    assert result.comparison["output_sqnr_db"]["lin"] > 30  # plain bf16 rounding upstream is fine
    assert not [g for g in result.findings if g.severity == "error"]


def test_compare_gradient_underflow_in_fp16_without_scaling() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.randn(4, 8)

    def run(m: nn.Module) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(x)
        return out.float().mean() * 1e-8  # gradients of ~2e-9: below fp16's smallest subnormal (6e-8)

    unscaled = diagnose_step(model, run, precision="fp16", bisect=False)
    (f,) = [f for f in unscaled.findings if f.code == "GRADIENT_UNDERFLOW"]
    assert f.evidence["fraction"] > 0.9
    assert f.module in ("0", "2")
    assert "loss scaling" in f.fix
    scaled = diagnose_step(model, run, precision="fp16", loss_scale=2.0**16, bisect=False)
    assert not [g for g in scaled.findings if g.code == "GRADIENT_UNDERFLOW"]
    assert scaled.comparison["grad_underflow"]["0"] == 0.0


class ScaledBranchNet(nn.Module):
    """A stem on the trunk, then a residual branch behind a layer scale of 1e-6 (ConvNeXt's init)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.branch = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)
        self.gamma = nn.Parameter(torch.full((8,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return self.head(h + self.gamma * self.branch(torch.tanh(h)))


def test_compare_gradient_underflow_names_the_most_flushed_module_not_the_first() -> None:
    x = torch.randn(8, 8)

    def run(m: nn.Module) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(x)
        return out.float().pow(2).mean()

    result = diagnose_step(ScaledBranchNet(), run, precision="fp16", bisect=False)
    (f,) = [f for f in result.findings if f.code == "GRADIENT_UNDERFLOW"]
    assert f.module == "branch"
    shares = f.evidence["shares"]
    assert shares["branch"]["share"] == 1.0 and shares["branch"]["nonzero_fp32"] == 72
    assert "stem" not in shares and result.comparison["grad_underflow"]["stem"] == 0.0


def test_compare_grads_zero_of_a_large_gradient_is_not_a_flush() -> None:
    ref = {"a.weight": torch.tensor([1e-9, 0.5, 2.0])}
    low = {"a.weight": torch.tensor([0.0, 0.0, 2.0])}
    bound = flush_bound(torch.float16, 1.0)
    cmp = compare_grads(ref, low, inv_scale=1.0, param_module={"a.weight": "a"}, flushed_below=bound)
    assert cmp.underflow["a"] == (1, 3)  # 0.5 -> 0 is a different decision (a ReLU, a max), not underflow
    assert flush_bound(torch.bfloat16, 1.0) < 1e-30
    assert flush_bound(torch.float16, 1024.0) == bound / 1024


def test_compare_grads_counts_lost_elements_per_module() -> None:
    ref = {"a.weight": torch.tensor([1e-3, 2e-3, 0.0, 4e-3]), "b.weight": torch.tensor([1.0, 1.0])}
    low = {"a.weight": torch.tensor([1e-3, 0.0, 0.0, 0.0]) * 8, "b.weight": torch.tensor([1.0, 1.0]) * 8}
    cmp = compare_grads(ref, low, inv_scale=1 / 8, param_module={"a.weight": "a", "b.weight": "b"})
    assert cmp.underflow["a"] == (2, 3)
    assert cmp.underflow_frac("b") == 0.0
    assert cmp.sqnr_db["b"] == math.inf
    assert cmp.sqnr_db["a"] == pytest.approx(10 * math.log10((1 + 4 + 16) / (4 + 16)))


def test_compare_healthy_bf16_transformer_has_no_findings() -> None:
    model = GPT(GPTConfig(n_layer=1, d_model=32, n_head=2, block_size=16))
    idx = torch.randint(0, 256, (2, 17))

    def run(m: nn.Module) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return GPT.loss(m(idx[:, :-1]), idx[:, 1:])

    result = diagnose_step(model, run, precision="bf16")
    assert result.findings == []
    assert min(result.comparison["output_sqnr_db"].values()) > SQNR_THRESHOLD_DB
    assert result.comparison["grad_global_sqnr_db"] > SQNR_THRESHOLD_DB
    assert set(result.module_headroom) >= {"blocks.0.attn", "blocks.0.mlp.fc", "lm_head"}
    assert result.module_headroom["blocks.0.mlp.fc"]["fp16"][0] > 0


def _conv_block(inplace: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=inplace),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def test_compare_batchnorm_before_inplace_relu_is_compared_before_the_relu_rewrites_it() -> None:
    # The standard ResNet block: the in-place ReLU overwrites the BatchNorm's output in both runs; the
    # kept fp32 reference must be the value the BatchNorm returned, or the BatchNorm reads about 0 dB.
    x = torch.randn(8, 3, 16, 16)
    inplace = diagnose_step(_conv_block(True), dm.bf16_run(x), precision="bf16", bisect=False)
    copy = diagnose_step(_conv_block(False), dm.bf16_run(x), precision="bf16", bisect=False)
    assert not [f for f in inplace.findings if f.code == "PRECISION_LOSS"]
    bn_inplace, bn_copy = inplace.comparison["output_sqnr_db"]["1"], copy.comparison["output_sqnr_db"]["1"]
    assert bn_copy > 30 and abs(bn_inplace - bn_copy) < 1.0
