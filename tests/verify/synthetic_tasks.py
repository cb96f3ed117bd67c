"""Small tasks for the verify tests: real models and data, each step a few milliseconds."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ampkit.tasks import TaskBase


class Regression(TaskBase):
    """An MLP fitting a fixed random teacher; metrics: test MSE (lower) and R² (higher)."""

    name = "regression"
    metrics = {"mse": "lower", "r2": "higher"}  # noqa: RUF012
    samples_per_batch = 256
    default_steps = 40
    default_warmup = 5
    default_eval_every = 20
    lr = 1e-3
    """Batch 256 and lr 1e-3 keep fp32's run-to-run spread (the noise band) near 0.4 % of the loss
    range and 0.03 % of the metrics at 40 steps: a low precision that matches fp32 passes."""

    def __init__(self, width: int = 64, features: int = 32) -> None:
        self.width, self.features = width, features
        gen = torch.Generator().manual_seed(1234)
        self.teacher = torch.randn(features, 1, generator=gen) / features**0.5
        self.test_x = torch.randn(256, features, generator=gen)
        self.test_y = self.test_x @ self.teacher

    def build_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(self.features, self.width), nn.GELU(), nn.Linear(self.width, 1))

    def batches(self, seed: int, device: torch.device) -> Iterator[Any]:
        gen = torch.Generator().manual_seed(seed)
        while True:
            x = torch.randn(self.samples_per_batch, self.features, generator=gen)
            yield x.to(device), (x @ self.teacher).to(device)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(model(x).float(), y)

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        pred = model(self.test_x.to(device)).float().cpu()
        mse = F.mse_loss(pred, self.test_y)
        return {"mse": float(mse), "r2": float(1 - mse / self.test_y.var())}


class WideRegression(Regression):
    """Tens of milliseconds per step, and an evaluation that costs about ten steps.

    A throughput figure that counted evaluation time would be off by ~20 % on this task.
    """

    name = "wide-regression"
    samples_per_batch = 256
    tokens_per_batch = 256 * 8

    def __init__(self) -> None:
        super().__init__(width=768, features=256)

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        time.sleep(0.4)
        return super().evaluate(model, device)


class Fp16Overflow(Regression):
    """Fails on purpose under fp16 only: the squared error is reduced by a matmul in the autocast dtype.

    The residual has an unlearnable noise part of size ~300, so a 256-term dot product of it is ~1e7:
    finite in fp32 and bf16 (fp32's exponent range), inf in fp16 (max 65504).  A CPU fp16 step is
    slow, so the model is tiny.
    """

    name = "fp16-overflow"
    metrics = {"mse": "lower"}  # noqa: RUF012
    default_steps = 30
    default_eval_every = 10

    def __init__(self) -> None:
        super().__init__(width=16, features=8)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        noise = 300.0 * torch.sin(1e3 * x.sum(dim=1, keepdim=True))  # deterministic, not learnable by the MLP
        err = (model(x) - y - noise).reshape(1, 1, -1)
        energy = torch.bmm(err, err.transpose(1, 2))  # autocast runs bmm in fp16/bf16: the overflow
        return energy.float().reshape(()) / (self.samples_per_batch * 9e4)

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        return {"mse": super().evaluate(model, device)["mse"]}


class Faulty(Regression):
    """Each low precision breaks its worker on the 3rd step: bf16 raises, fp16 is SIGKILLed (as by the OOM killer)."""

    name = "faulty"

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        self.calls += 1
        if self.calls == 3 and torch.is_autocast_enabled("cpu"):
            if torch.get_autocast_dtype("cpu") == torch.bfloat16:
                raise RuntimeError("synthetic failure in the bf16 run")
            os.kill(os.getpid(), signal.SIGKILL)
        return super().loss(model, batch)


class Slow(Regression):
    """Sleeps 50 ms a step so a test can interrupt the job while a worker runs."""

    name = "slow"
    default_steps = 400

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        time.sleep(0.05)
        return super().loss(model, batch)


class Hostile(Regression):
    """Names that would inject markup if a report forgot to escape them."""

    name = "<script>alert('task')</script>"
    metrics = {"<img src=x onerror=alert(1)>": "lower", "r2 & $\\alpha$ | x": "higher"}  # noqa: RUF012

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        m = super().evaluate(model, device)
        return {"<img src=x onerror=alert(1)>": m["mse"], "r2 & $\\alpha$ | x": m["r2"]}


class NotATask:
    name = "not-a-task"


task = Regression()


class Steady(Regression):
    """Every step sleeps 50 ms: a fixed step time, so a time budget's effect does not depend on the machine."""

    name = "steady"

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        time.sleep(0.05)
        return super().loss(model, batch)


class SlowLowPrecision(Regression):
    """Sleeps 200 ms a step under autocast only: a low precision with no speed-up, and fp32's numerics.

    200 ms, not less: on a loaded 2-core machine fp32's own step of this task has taken over 50 ms."""

    name = "slow-low-precision"
    default_steps = 20

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        if torch.is_autocast_enabled("cpu"):
            time.sleep(0.2)
        return super().loss(model, batch)


class LabelNoise(Regression):
    """Known fp32 noise: labels carry noise of standard deviation 1 (the signal's own) and batches are
    8 samples, so two data orders train visibly different models.  The fp32 noise band is wide, and a
    low precision that matches fp32 is inconclusive, not a pass."""

    name = "label-noise"
    samples_per_batch = 8
    lr = 3e-3

    def batches(self, seed: int, device: torch.device) -> Iterator[Any]:
        gen = torch.Generator().manual_seed(seed)
        while True:
            x = torch.randn(self.samples_per_batch, self.features, generator=gen)
            noise = torch.randn(self.samples_per_batch, 1, generator=gen)
            yield x.to(device), (x @ self.teacher + noise).to(device)


class OffsetTarget(Regression):
    """A real bf16 failure: the targets sit near 256, where bf16's spacing is 2, and the signal is about
    +-1 around it.  The prediction ``model(x) + 256`` stays in the autocast dtype, so bf16 rounds the
    signal away while fp32 learns it: the distance is far beyond the tolerance and the noise band."""

    name = "offset-target"
    OFFSET = 256.0

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss((model(x) + self.OFFSET).float(), y + self.OFFSET)

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        pred = (model(self.test_x.to(device)) + self.OFFSET).float().cpu() - self.OFFSET
        mse = F.mse_loss(pred, self.test_y)
        return {"mse": float(mse), "r2": float(1 - mse / self.test_y.var())}


class Finite(Regression):
    """A ``batches()`` that ends after 10 batches: a one-epoch loader written as a finite generator."""

    name = "finite"

    def batches(self, seed: int, device: torch.device) -> Iterator[Any]:
        stream = super().batches(seed, device)
        for _ in range(10):
            yield next(stream)
