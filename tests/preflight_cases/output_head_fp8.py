"""An output head that loses its logits in fp8: the reason training recipes keep the final projection out.

Report: pytorch/torchtitan #469 ("[float8] keep model.output as nn.Linear (high precision, not fp8)":
"it's a common practice to NOT apply fp8 on final output layer"), and the same filter in torchtune's fp8
recipe (meta-pytorch/torchtune #2404, where a torchao maintainer answers why: "the first and last layers
are often sensitive to low precision"); DeepSeek-V3 (arXiv:2412.19437, its mixed-precision framework) keeps
the output head in its original precision.  What makes an LM head sensitive: its rows share a large common vector (the
output embeddings' anisotropy, Gao et al. 2019, "Representation Degeneration Problem in Training Natural
Language Generation Models", arXiv:1907.12009), so each logit is a large shared part plus a small
class-specific one.  e4m3 rounds each weight to 1 part in 16 of its own size (per tensor, per row or per
block of 32 alike), an error of the shared part's size that swamps the class-specific part; bf16 rounds to
1 part in 256.

The model: two pre-norm MLP blocks and a head whose every row is a shared vector four times the size of the
row's own part.

Expected: fp8, fp8-rowwise, fp8-rowwise-gw-hp, MXFP8 and NVFP4 ``policy`` keeping ``head`` out of the
format (``fp8_filter``); fp16 and bf16 ``safe``.
"""

from __future__ import annotations

import torch
from _case import D_IN, CaseTask, PreNormMLP
from torch import nn


class OutputHeadCase(CaseTask):
    name = "output_head_fp8"
    shared = 4.0
    """The shared row, in units of a row's own initialisation."""

    def make_model(self) -> nn.Module:
        model = PreNormMLP(hidden=2 * D_IN)
        with torch.no_grad():
            row = model.head.weight
            common = torch.randn(row.shape[1]) * row.std() * self.shared
            row.add_(common)
        return model


task = OutputHeadCase()
