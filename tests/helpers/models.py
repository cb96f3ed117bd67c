"""Small models and data shared by the engine tests."""

from __future__ import annotations

import torch
from torch import nn


class TinyNet(nn.Module):
    """Linear -> LayerNorm -> GELU -> Linear: matmuls (autocast to low precision) and a norm (fp32)."""

    def __init__(self, d_in: int = 16, d_hidden: int = 32, d_out: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.norm = nn.LayerNorm(d_hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.norm(self.fc1(x))))


def make_batches(n: int, *, batch: int = 8, d_in: int = 16, classes: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, d_in, generator=g), torch.randint(0, classes, (batch,), generator=g)) for _ in range(n)]


def clone_model_and_opt(model: nn.Module, make_opt):
    import copy

    twin = copy.deepcopy(model)
    return twin, make_opt(twin)
