"""An attention mask filled with -1e9 raises under fp16 autocast.

Report: huggingface/transformers #382 ("fp16 overflow in GPT-2": the attention mask multiplied by 1e10),
NVIDIA/apex #1105 ("RuntimeError: value cannot be converted to type at::Half without overflow:
-1e+10", from ``attn_scores.masked_fill(mask == 0, -1e10)`` in mixed-precision training) and
facebookresearch/fairseq #3575 (the same error from the encoder's ``attn_mask`` in fp16 mode, "-1e+08 is
too large for fp16"): under fp16 autocast the attention scores come out of a matmul in fp16, and filling
them with a constant beyond 65,504 raises.  bf16 represents -1e9 (its range is fp32's); the fix is a mask
value within the dtype (``torch.finfo(scores.dtype).min``) or the attention computed in fp32.

The model: one block of causal self-attention written by hand (scores masked with -1e9, then softmax) and
an MLP, pre-norm.

Expected: fp16 ``policy`` keeping ``blocks.0.attn`` in fp32; bf16 ``safe``; fp8, fp8-rowwise,
fp8-rowwise-gw-hp, MXFP8 and NVFP4 ``safe`` (the scores come out of a bf16 matmul).
"""

from __future__ import annotations

import math

import torch
from _case import D_IN, OUT, AttentionBlock, CaseTask
from torch import nn


class MaskedAttention(nn.Module):
    def __init__(self, d: int, heads: int, mask_value: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.mask_value = mask_value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(c // self.heads)
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(future, self.mask_value)
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, c)
        return self.out(y)


class MaskedTransformer(nn.Module):
    def __init__(self, mask_value: float, d: int = D_IN, heads: int = 2) -> None:
        super().__init__()
        self.blocks = nn.Sequential(AttentionBlock(d, MaskedAttention(d, heads, mask_value)))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(x)))


class AttentionMaskCase(CaseTask):
    name = "attention_mask_fp16"
    mask_value = -1e9

    def make_model(self) -> nn.Module:
        return MaskedTransformer(self.mask_value)


task = AttentionMaskCase()
