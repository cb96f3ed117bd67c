"""Massive activations at the first token break tensorwise fp8, not rowwise fp8 or MXFP8.

Report: Sun et al. 2024, "Massive Activations in Large Language Models" (arXiv:2402.17762): a few
activations, in fixed feature dimensions and at the starting token (or the first delimiter), are about
10,000 times the median; they arise in an early layer's MLP (the down projection's input) and act as
fixed biases.  One per-tensor fp8 scale is set by those few values, so the other tokens' values of that
tensor fall below e4m3's smallest subnormal and flush to zero; a scale per row (per token) or per block
of 32 values confines the damage to the first token's own row or blocks.

The model: two pre-norm ReLU MLP blocks (ReLU as in OPT, one of the families Sun et al. measure); in the
first, the MLP's intermediate activation (the down projection's input, ~0.03 typical) takes the value 2e4
at the first position in two fixed dimensions (a buffer: the weights that make massive activations in LLMs
are what a long pre-training run leaves, not what 30 steps learn), and its down projection is large where
the activation is small, so the MLP's output is of the residual's size.  Sequences are 256 positions long, so the first positions are 1/256 of the rows.

Expected: fp8 (tensorwise) ``policy`` keeping ``blocks.0.mlp.down`` out of fp8 (``fp8_filter``);
fp8-rowwise, fp8-rowwise-gw-hp and MXFP8 ``safe``; NVFP4 ``policy`` with the same filter (its fp32
per-tensor scale is set by the outliers too, so the other blocks' e4m3 block scales fall into e4m3's
subnormals); fp16 and bf16 ``safe`` (2e4 is within fp16's range).
"""

from __future__ import annotations

import torch
from _case import D_IN, OUT, CaseTask
from torch import nn
from torch.nn import functional as F


class MLP(nn.Module):
    def __init__(self, d: int, d_ff: int, massive: float) -> None:
        super().__init__()
        self.up = nn.Linear(d, d_ff)
        self.down = nn.Linear(d_ff, d)
        sink = torch.zeros(d_ff)
        sink[[7, 91]] = massive
        self.register_buffer("sink", sink)
        """Added to the first token's intermediate activation: the massive activations (0 elsewhere)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.up(x))
        first = torch.zeros_like(h[:1, :, :1])
        first[:, 0] = 1.0
        return self.down(h + first * self.sink.to(h.dtype))


class Block(nn.Module):
    def __init__(self, d: int, d_ff: int, massive: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = MLP(d, d_ff, massive)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class MassiveLM(nn.Module):
    def __init__(self, massive: float, d: int = D_IN, d_ff: int = 128) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(d, d_ff, massive), Block(d, d_ff, 0.0))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(x)))


class MassiveActivationsCase(CaseTask):
    name = "massive_activations"
    rows, seq_len = 4, 256
    massive = 2e4
    up_gain = 0.1
    """The first MLP's up projection, times this: its activations are ~0.03, a millionth of the massive ones."""
    down_gain = 40.0
    """The first MLP's down projection (but the massive dimensions' columns), times this."""

    def make_model(self) -> nn.Module:
        model = MassiveLM(self.massive)
        mlp = model.blocks[0].mlp
        with torch.no_grad():
            mlp.up.weight.mul_(self.up_gain)
            mlp.up.bias.mul_(self.up_gain)
            ordinary = mlp.sink == 0
            mlp.down.weight[:, ordinary] *= self.down_gain
        return model


task = MassiveActivationsCase()
