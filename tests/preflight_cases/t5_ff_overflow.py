"""T5's feed-forward overflows fp16 in a late block.

Report: huggingface/transformers #5651 ("T5 fp16 overflow in forward (T5DenseReluDense)": ``h =
self.wo(h)`` gives 66,246 in fp32, inf in fp16), #9295 ("T5 FP16 in Pytorch", T5 v1.1 base/large) and the
PR #10956 ("[T5/MT5] resolve inf/nan under amp"): the output of the feed-forward's output projection ``wo``
passes fp16's largest value, 65,504, so fp16 training produces inf and then a NaN loss, while bf16 runs fine
(T5 was pre-trained with bf16 activations: google-research/text-to-text-transfer-transformer #539).  The
fixes clamped the hidden states and then kept ``wo`` in fp32 (``_keep_in_fp32_modules = ["wo"]``, PR #20683).

The model: three T5 blocks (RMSNorm and the original T5's feed-forward ``wo(relu(wi(x)))``,
``T5DenseReluDense``), the last one with the large weights of a long pre-training run, so that its ``wo``
output reaches a few 1e5.

Expected: fp16 ``policy``, keeping ``blocks.2.ff.wo`` (or the whole ``blocks.2.ff``) in fp32; bf16
``safe`` (its range is fp32's); the fp8 recipes and MXFP8 ``safe`` (they scale each operand to its own
range, and the rest runs in bf16); NVFP4 ``safe``.
"""

from __future__ import annotations

import torch
from _case import D_IN, OUT, CaseTask, RMSNorm
from torch import nn
from torch.nn import functional as F


class DenseReluDense(nn.Module):
    def __init__(self, d: int, d_ff: int) -> None:
        super().__init__()
        self.wi = nn.Linear(d, d_ff, bias=False)
        self.wo = nn.Linear(d_ff, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(F.relu(self.wi(x)))


class T5Block(nn.Module):
    def __init__(self, d: int, d_ff: int) -> None:
        super().__init__()
        self.norm = RMSNorm(d)
        self.ff = DenseReluDense(d, d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class T5Stack(nn.Module):
    def __init__(self, d: int = D_IN, d_ff: int = 64, layers: int = 3) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(T5Block(d, d_ff) for _ in range(layers)))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, OUT, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(x)))


class T5FFOverflowCase(CaseTask):
    name = "t5_ff_overflow"
    late_gain = 520.0
    """Both of the last block's feed-forward weights, times this: its ``wo`` output peaks near 3e5."""

    def make_model(self) -> nn.Module:
        model = T5Stack()
        with torch.no_grad():
            ff = model.blocks[-1].ff
            for layer in (ff.wi, ff.wo):
                layer.weight.mul_(self.late_gain)
        return model


task = T5FFOverflowCase()
