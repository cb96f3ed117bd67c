"""A residual stream that grows with depth (Gemma-style) overflows fp16 in the late blocks.

Report: Gemma multiplies its embeddings by sqrt(d_model) and its blocks add outputs that grow with depth
("with each forward pass, the values keep increasing", huggingface/transformers #39972; "Gemma 3 is broken
with fp16", #36822); in fp16 they overflow to inf and the loss goes NaN, while bf16 is unaffected.  Under fp16
autocast the first inf is an MLP's down projection output, which then poisons the residual stream
(unslothai/unsloth-zoo #600, Gemma-4 GRPO: "the first overflow occurs in ... mlp.down_proj").  Under
autocast the stream itself stays fp32 where it starts from the (fp32) inputs; what overflows is the output
of the late blocks' MLPs, the adds that make it grow.

The model: the inputs times sqrt(d) (Gemma's embedding normalizer), four pre-norm MLP blocks whose down
projections are 8x larger per block (a residual that grows with depth), so that the last two blocks' MLP
outputs pass 65,504.

Expected: fp16 ``policy`` keeping the down projections of the two late blocks (``blocks.2.mlp.down``,
``blocks.3.mlp.down``) in fp32; bf16 ``safe``.  The fp8 recipes, MXFP8 and NVFP4 were expected ``safe``
(each operand scaled to its own range); training showed the fp8 recipes failing instead, so they are
``unsafe``: each block's output outweighs the stream it is added to, so the model is in effect a chain of
eight GEMMs without a clean residual path, and e4m3's error compounds through it (keeping all four down
projections out of fp8 still leaves it beyond tolerance); MXFP8 and NVFP4, not trained, share the elements.
"""

from __future__ import annotations

import math

import torch
from _case import D_IN, OUT, CaseTask, GeluMLP, RMSNorm
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = RMSNorm(d)
        self.mlp = GeluMLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class GemmaLike(nn.Module):
    def __init__(self, d: int = D_IN, layers: int = 4) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(d) for _ in range(layers)))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, OUT, bias=False)
        self.normalizer = math.sqrt(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(x * self.normalizer)))


class ResidualGrowthCase(CaseTask):
    name = "residual_growth"
    growth = 8.0
    """Block i's down projection is ``base_gain × growth**i`` times its initialisation: block 1 peaks near 2e4, block 2 near 1.5e5."""
    base_gain = 3000.0

    def make_model(self) -> nn.Module:
        model = GemmaLike()
        with torch.no_grad():
            for i, block in enumerate(model.blocks):
                block.mlp.down.weight.mul_(self.base_gain * self.growth**i)
                block.mlp.down.bias.zero_()
        return model


task = ResidualGrowthCase()
