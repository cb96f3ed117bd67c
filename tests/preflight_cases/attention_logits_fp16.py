"""Attention logits without the 1/sqrt(d) scale overflow fp16.

Report: stanford-crfm/mistral #66 (GPT-2 runs whose q @ k^T overflowed fp16 before the 1/sqrt(d) scale;
fixed by scaling first and upcasting, which became ``reorder_and_upcast_attn`` in huggingface/transformers
PR #13573), Stability-AI/stablediffusion PR #89 ("force cast to fp32 to avoid atten layer overflow") and
ultralytics/ultralytics PR #24990 ("the unscaled QK^T overflow[s] ... and turn[s] the softmax into NaN");
Dehghani et al. 2023, "Scaling Vision Transformers to 22 Billion Parameters" (arXiv:2302.05442): attention
logits that grow without bound.  Here the scores are computed as q @ k^T without dividing by sqrt(head_dim), with queries and
keys of a long-trained model's size, so they pass 65,504 in fp16 and the softmax gives NaN; bf16 has the
range.

The model: one pre-norm block of hand-written non-causal self-attention (no 1/sqrt(d) scale; the query
and key projections large, so the softmax is nearly one-hot, and its output a modest correction to the
residual) and an MLP.

Expected: fp16 ``policy`` keeping ``blocks.0.attn`` in fp32; bf16 ``safe``; fp8, fp8-rowwise,
fp8-rowwise-gw-hp, MXFP8 and NVFP4 ``safe`` (each operand scaled to its range, the scores in bf16).
"""

from __future__ import annotations

import torch
from _case import D_IN, OUT, AttentionBlock, CaseTask
from torch import nn


class UnscaledAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, c // self.heads).transpose(1, 2)

        scores = split(self.q(x)) @ split(self.k(x)).transpose(-2, -1)  # no 1/sqrt(head_dim)
        y = (scores.softmax(-1) @ split(self.v(x))).transpose(1, 2).reshape(b, t, c)
        return self.out(y)


class AttentionModel(nn.Module):
    def __init__(self, d: int = D_IN, heads: int = 2) -> None:
        super().__init__()
        self.blocks = nn.Sequential(AttentionBlock(d, UnscaledAttention(d, heads)))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(x)))


class AttentionLogitsCase(CaseTask):
    name = "attention_logits_fp16"
    qk_gain = 150.0
    """The query and key projections, times this: the largest score is about 1.2e5."""
    out_gain = 0.3
    """The attention's output projection, times this: the attention adds a modest correction to the
    residual stream."""

    def make_model(self) -> nn.Module:
        model = AttentionModel()
        with torch.no_grad():
            attn = model.blocks[0].attn
            attn.q.weight.mul_(self.qk_gain)
            attn.k.weight.mul_(self.qk_gain)
            attn.out.weight.mul_(self.out_gain)
        return model


task = AttentionLogitsCase()
