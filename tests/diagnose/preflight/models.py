"""Tiny models for the preflight tests: a healthy one, and a T5-style feed-forward that overflows fp16 late."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class FeedForward(nn.Module):
    def __init__(self, d: int, gain: float = 1.0) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.wi = nn.Linear(d, 4 * d)
        self.wo = nn.Linear(4 * d, d)
        with torch.no_grad():
            self.wo.weight.mul_(gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.wo(torch.relu(self.wi(self.ln(x))))


class Stack(nn.Module):
    """Three pre-norm feed-forward blocks and a head; ``gain`` scales the last block's output projection."""

    def __init__(self, gain: float = 1.0, d: int = 32) -> None:
        super().__init__()
        self.blocks = nn.Sequential(FeedForward(d), FeedForward(d), FeedForward(d, gain))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(x)))


def batches(seed: int = 0, count: int = 1, d: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, d, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(count)]


def loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x).float(), y)


OVERFLOW_GAIN = 3e5
"""Enough for blocks.2.wo's output to pass fp16's 65504 (about 2e5 in fp32), while bf16 holds it."""
