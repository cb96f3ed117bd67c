"""Outlier feature dimensions hurt NVFP4 most.

Report: Dettmers et al. 2022, "LLM.int8(): 8-bit Matrix Multiplication for Transformers at Scale"
(arXiv:2208.07339): from about 6.7B parameters on, a few hidden dimensions carry values up to 20-60
times the others, in every token and layer (they sit in the LayerNorm outputs that feed the attention and
feed-forward projections); a quantizer whose scale covers them loses the other dimensions.  With fp8's
per-tensor or per-row scale the others keep e4m3's 3 mantissa bits (its range spans 2^17), and an MXFP8
block of 32 has the same range; NVFP4's 16-value blocks of e2m1 (largest 6, smallest non-zero 0.5) flush
every value below a 24th of the block's largest, so a block holding an outlier loses nearly all the rest.

The model: two pre-norm ReLU MLP blocks (as OPT's, one of the families LLM.int8() measures) whose
LayerNorm gains are 40 in four dimensions, one in each 16-value block of the 64-wide stream, as a
pre-trained model's outlier dimensions are; each MLP adds a modest correction to the residual stream (its
down projection a quarter of its initialisation).

Expected: NVFP4 ``policy`` keeping the two up projections that read the outliers (``blocks.0.up``,
``blocks.1.up``) out of the format (``fp8_filter``); every other format ``safe`` (fp16, bf16, fp8,
fp8-rowwise, fp8-rowwise-gw-hp, MXFP8).
"""

from __future__ import annotations

import torch
from _case import D_IN, OUT, CaseTask, PreNormBlock
from torch import nn
from torch.nn import functional as F


class OutlierMLP(nn.Module):
    def __init__(self, d: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.proj = nn.Linear(D_IN, d)
        self.blocks = nn.Sequential(*(PreNormBlock(d, 2 * d, F.relu) for _ in range(layers)))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.proj(x))))


class OutlierChannelCase(CaseTask):
    name = "outlier_channel"
    outlier_dims = (5, 21, 37, 53)
    """One in each 16-value block of the 64-wide stream."""
    outlier_gain = 40.0
    down_gain = 0.25
    """The down projections, times this: each MLP adds a modest correction to the residual stream, which
    carries most of what the head reads."""

    def make_model(self) -> nn.Module:
        model = OutlierMLP()
        with torch.no_grad():
            for block in model.blocks:
                block.norm.weight[list(self.outlier_dims)] = self.outlier_gain
                block.down.weight.mul_(self.down_gain)
        return model


task = OutlierChannelCase()
