"""A healthy small model: every format trains it like fp32.

Report: the control of the corpus.  A pre-norm MLP model at its default initialisation, with LayerNorm'd
inputs to every Linear and nothing scaled by hand, is the model the format thresholds were derived on
(``ampkit.thresholds.FORMAT_SQNR``: the lowest SQNR on well-scaled models minus 8 dB); torchao's
float8 recipes and ampkit's fp16/bf16 autocast train such models as fp32 does.

Expected: every format ``safe`` (fp16, bf16, fp8, fp8-rowwise, fp8-rowwise-gw-hp, mxfp8, nvfp4).
"""

from __future__ import annotations

from _case import D_IN, CaseTask, PreNormMLP
from torch import nn


class HealthyCase(CaseTask):
    name = "healthy"

    def make_model(self) -> nn.Module:
        return PreNormMLP(hidden=4 * D_IN)


task = HealthyCase()
