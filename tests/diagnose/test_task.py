"""diagnose_task on small Task objects, and the measured SLOW_LOW_PRECISION check."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from ampkit.diagnose.core.perf import low_precision_speed
from ampkit.diagnose.task import diagnose_task
from ampkit.tasks.gpt import GPT, GPTConfig


class TinyGPTTask:
    name = "tiny-gpt"

    def build_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return GPT(GPTConfig(n_layer=1, d_model=32, n_head=2, block_size=16))

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=1e-3)

    def batches(self, seed: int, device: torch.device) -> Iterator[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        while True:
            yield torch.randint(0, 256, (2, 17), generator=g).to(device)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return GPT.loss(model(batch[:, :-1]), batch[:, 1:])

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        return {}


class NanDataTask(TinyGPTTask):
    name = "nan-data"

    def build_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def batches(self, seed: int, device: torch.device) -> Iterator[torch.Tensor]:
        for i in range(10):
            x = torch.randn(3, 4)
            if i == 2:
                x[1, 1] = float("nan")
            yield x

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return model(batch).float().pow(2).mean()


def test_task_healthy_task_has_no_findings() -> None:
    result = diagnose_task(TinyGPTTask(), "bf16", steps=3, check_speed=False)
    assert result.findings == []
    assert result.environment is not None and result.environment["task"] == "tiny-gpt"
    assert "blocks.0.attn" in result.module_headroom


def test_task_failing_step_is_replayed_and_reported() -> None:
    result = diagnose_task(NanDataTask(), "bf16", steps=5, check_speed=False)
    (f,) = result.findings
    assert (f.code, f.step, f.module) == ("NONFINITE_INPUT", 3, "0")


def test_task_rejects_negative_steps() -> None:
    with pytest.raises(ValueError, match="steps"):
        diagnose_task(TinyGPTTask(), "bf16", steps=-1)


def test_perf_slow_low_precision_reports_the_measured_ratio() -> None:
    # slow_ratio above any real ratio makes the finding fire on every CPU, so the measurement and
    # the message are checked without depending on which CPU this test runs on.
    f = low_precision_speed("fp16", "cpu", slow_ratio=1e9)
    assert f is not None and f.code == "SLOW_LOW_PRECISION"
    ratio = f.evidence["ratio_vs_fp32"]
    # The evidence keeps the unrounded throughputs, so the ratio is theirs to the last bit.
    assert ratio > 0 and ratio == pytest.approx(f.evidence["tflops"]["fp16"] / f.evidence["tflops"]["fp32"], rel=1e-12)
    assert f.evidence["judgement"] == {"metric": "ratio_vs_fp32", "value": ratio, "threshold": 1e9,
                                       "margin": pytest.approx(1.2e8), "reports_when": "below", "outcome": "reported"}
    assert "fp16" in f.message and f"{1 / ratio:.1f}×" in f.message


def test_perf_fast_enough_low_precision_reports_nothing() -> None:
    assert low_precision_speed("fp16", "cpu", slow_ratio=0.0) is None
