"""Tiny models and a training step for the telemetry tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import ampkit
from ampkit.telemetry import metrics


class TinyRegressor(nn.Module):
    """Embedding rows that a batch never indexes get exactly-zero gradients (the zero fraction)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return self.body(torch.cat([x, self.emb(idx)], dim=-1))


def train_step(mp: ampkit.MixedPrecision, model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
               idx: torch.Tensor, y: torch.Tensor, *, loss_fn: Callable[..., torch.Tensor] | None = None
               ) -> ampkit.StepResult:
    with mp.autocast():
        out = model(x, idx)
        loss = loss_fn(out, y) if loss_fn is not None else (out.float() - y).pow(2).mean()
    mp.backward(loss)
    return mp.step(opt)


def batch(n: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Features, embedding indices drawn from rows 0-4 only (rows 5-9 get zero grads), targets."""
    return torch.randn(n, 4), torch.randint(0, 5, (n,)), torch.randn(n, 1)


# Each of these makes the host wait for the device (or reads a CPU tensor the way it would).
FORBIDDEN = ("item", "__bool__", "cpu", "tolist", "numpy", "__float__", "__int__", "__index__")


class ForbiddenSync(AssertionError):
    """A sync method was called where the telemetry promises none."""


def count_as_on_an_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the gradient counts take the accelerator's path on this CPU.

    On CPU ``GradCounter`` and ``Telemetry`` read one scalar per step to skip work, which waits for
    nothing there; on an accelerator that read would be a sync, so the no-sync tests check the
    accelerator's path.  Call it before the telemetry attaches.
    """
    monkeypatch.setattr(metrics, "reads_are_free", lambda device: False)
