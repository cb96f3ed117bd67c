"""The gradient-penalty watcher on its own (no Context): gradients of a scaled loss used in the next
loss without the unscale are GRADIENT_PENALTY_SCALED; unscaled as torch's recipe does, nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampkit.diagnose.script.watchers.penalty import GradPenaltyWatch, reaches_unscaled

from .alone import watching


def _penalty_step(unscale: str) -> list[str]:
    model = nn.Linear(4, 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with watching(GradPenaltyWatch) as w:
        # The watcher reads scaled outputs from the registry the scaler watcher fills; register as it does.
        loss = model(torch.randn(8, 4)).pow(2).mean()
        scaled = scaler.scale(loss)
        w.state.scalers.register_scaled(loss, scaled, torch.tensor(1024.0), True, "torch")
        grads = torch.autograd.grad(scaled, list(model.parameters()), create_graph=True)
        if unscale == "each":
            grads = tuple(g * (1.0 / scaler.get_scale()) for g in grads)
        penalty = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
        if unscale == "norm":
            penalty = penalty / scaler.get_scale()
        (loss + penalty).backward()
        return w.codes()


@pytest.mark.parametrize("unscale, codes", [("none", ["GRADIENT_PENALTY_SCALED"]), ("each", []), ("norm", [])])
def test_penalty_watch_alone_judges_gradients_of_a_scaled_loss(unscale: str, codes: list[str]) -> None:
    assert _penalty_step(unscale) == codes


def test_penalty_reaches_unscaled_needs_every_path_to_cross_an_unscale() -> None:
    w = torch.ones(3, requires_grad=True)
    (g,) = torch.autograd.grad((w * w).sum() * 8.0, [w], create_graph=True)
    both = g.sum() * 0.125 + g.sum()  # one path unscaled, one not
    assert reaches_unscaled(both.grad_fn, [g.grad_fn], 8.0)
    assert not reaches_unscaled((g.sum() * 0.125).grad_fn, [g.grad_fn], 8.0)
    assert not reaches_unscaled((g / 8.0).sum().grad_fn, [g.grad_fn], 8.0)
