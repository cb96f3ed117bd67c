"""A top-1 MoE router near a tie: low-precision rounding flips the expert choice.

Report: Fedus et al. 2021, "Switch Transformers" (arXiv:2101.03961, "selective precision"): computing the
router in bf16 made training unstable, so the router's input is cast to fp32 inside its own function
(Hugging Face's Switch Transformers config keeps ``router_dtype="float32"``); Zoph et al. 2022, "ST-MoE"
(arXiv:2202.08906): router logits grow large, and bf16's roundoff, which grows with the logits' size,
changes which expert is chosen.  DeepSeek-V3's fp8 training (arXiv:2412.19437, its mixed-precision
framework) keeps the MoE gating modules in their original precision.

The model: a residual block with a two-expert top-1 MoE (Switch routing: the chosen expert's output times
its softmax probability) whose output outweighs the residual it is added to.  The router's logits sit near
32 (a shared bias of 32) and differ between the experts by about 0.1: bf16's step at 32 is 0.25 and fp16's
0.03, so bf16 sends most positions to expert 0 and fp16 flips only the closest ones.  The router has two
outputs, so no fp8 recipe or block format converts it (16 and 32 do not divide 2): under them it runs in
bf16 autocast.

Expected: bf16 ``policy`` keeping ``moe.router`` in fp32; fp16 ``safe`` (written first as ``policy`` like
bf16; training showed its few flips do not move the loss, so that expectation was wrong); fp8, fp8-rowwise,
fp8-rowwise-gw-hp, MXFP8 and NVFP4 ``unsafe`` (the router is not a quantized layer, so no ``fp8_filter``
moves it out of bf16; what fixes them, the router in fp32, is a ``keep_fp32`` policy, which preflight
proposes for fp16/bf16 only).
"""

from __future__ import annotations

import torch
from _case import D_IN, OUT, CaseTask, GeluMLP
from torch import nn


class Top1MoE(nn.Module):
    def __init__(self, d: int, experts: int = 2) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts)
        self.experts = nn.ModuleList(GeluMLP(d) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).float().softmax(-1)
        gate, choice = probs.max(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            chosen = choice == i
            out[chosen] = (expert(x[chosen]) * gate[chosen, None].to(x.dtype)).to(out.dtype)
        return out


class MoEModel(nn.Module):
    def __init__(self, d: int = D_IN) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.moe = Top1MoE(d)
        self.final_norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.final_norm(x + self.moe(self.norm(x))))


class MoERouterTieCase(CaseTask):
    name = "moe_router_tie"
    logit_level = 32.0
    """The router's shared bias: where its logits sit."""
    router_gain = 0.2
    """The router's weights, times this: the experts' logits differ by ~0.1."""
    expert_gain = 6.0
    """The experts' down projections, times this: the MoE's output outweighs the residual it is added to."""

    def make_model(self) -> nn.Module:
        model = MoEModel()
        with torch.no_grad():
            model.moe.router.weight.mul_(self.router_gain)
            model.moe.router.bias.fill_(self.logit_level)
            for expert in model.moe.experts:
                expert.down.weight.mul_(self.expert_gain)
        return model


task = MoERouterTieCase()
