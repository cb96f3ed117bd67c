"""Gradients that underflow fp16 at the default initial loss scale of 65,536.

Report: Micikevicius et al. 2018, "Mixed Precision Training" (arXiv:1710.03740, section 3.2 and figure 3):
a large share of a network's activation gradients lie below fp16's smallest subnormal (2^-24) and become
zero, which loss scaling fixes; the reports on the PyTorch forums of GradScaler leaving the
gradients at zero are this when the loss itself is tiny: a loss weighted down by a small factor (an
auxiliary term, a sum normalised by a large count) leaves every scaled gradient under 2^-24 at the scaler's
initial 65,536, so every update is zero.  The dynamic scaler grows only after 2,000 clean steps, and a larger
initial scale (or no down-weighting) fixes it; bf16 has fp32's range and the fp8 recipes scale each
gradient tensor to its own range.

The model: the healthy two-block MLP, with its loss multiplied by 1e-10 and AdamW's eps by the same factor
(Adam is invariant to the loss's scale when eps scales with it, so fp32 trains as with the plain loss).

Expected: fp16 ``policy`` with ``init_scale`` 2^40 or more (the scale that lifts the gradients into fp16's
normal range); bf16, fp8, fp8-rowwise, fp8-rowwise-gw-hp, MXFP8 and NVFP4 ``safe``.
"""

from __future__ import annotations

from _case import D_IN, CaseTask, PreNormMLP
from torch import nn


class GradUnderflowCase(CaseTask):
    name = "grad_underflow_fp16"
    loss_weight = 1e-10
    eps = 1e-8 * loss_weight

    def make_model(self) -> nn.Module:
        return PreNormMLP(hidden=4 * D_IN)


task = GradUnderflowCase()
