"""A healthy small model: every format trains it like fp32.

Report: the control of the corpus.  A pre-norm MLP model at its default initialisation, with LayerNorm'd
inputs to every Linear and nothing scaled by hand, is the model the format thresholds were derived on
(``ampkit.thresholds.FORMAT_SQNR``: the lowest module SQNR on well-scaled models minus 10 dB); torchao's
float8 recipes and ampkit's fp16/bf16 autocast train such models as fp32 does.

Expected: every format ``safe`` (fp16, bf16, fp8, fp8-rowwise, fp8-rowwise-gw-hp, mxfp8, nvfp4).
"""

from __future__ import annotations

import torch
from _case import D_IN, OUT, CaseTask
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class HealthyMLP(nn.Module):
    def __init__(self, d: int = D_IN, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(d) for _ in range(layers)))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(x)))


class HealthyCase(CaseTask):
    name = "healthy"

    def make_model(self) -> nn.Module:
        return HealthyMLP()


task = HealthyCase()
