"""What every preflight corpus case shares: a distillation task on continuous inputs, its batches and loss.

Each case is a tiny model (width 32-64, 2-4 layers) built so that one public report's failure shows in
it.  The task around it is the same for all: the inputs are Gaussian sequences (``rows`` × ``seq_len`` ×
``D_IN``), fed to the model as its residual stream; the target of each position is what a *teacher*
computes in fp32: the case's own model at the same seed with its output head moved by a fresh draw.  The
student starts with the teacher's body and a wrong head, so in fp32 the loss falls fast towards 0 (the head
is a linear regression on the body's features) and the curve has a range to compare with.  A format that damages the
body's features (a flushed operand, a flipped routing decision, a lossy head) leaves an error no head can
fit, because fresh inputs each step carry information a deterministic corruption destroys; a per-token
lookup task would hide it (any corruption of a token's features is still a function of the token).

The loss is the mean squared error against the teacher, taken in fp32 (``output.float()``) whatever the
format, times ``loss_weight``: the cases test the model's numerics, not the loss's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ampkit.tasks.base import TaskBase

D_IN = 32
"""Width of the inputs, which are the model's residual stream at its first block."""
OUT = 64
"""Width of the output head; 64 is a multiple of 16 and 32, so the head converts to fp8 and MXFP8 like
the other Linear layers."""


class PreNormBlock(nn.Module):
    """``x + down(act(up(norm(x))))``: the pre-norm MLP block several cases build on."""

    def __init__(self, d: int, hidden: int, act: Any = F.gelu) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


class GeluMLP(nn.Module):
    """``down(gelu(up(x)))``, twice as wide inside: the feed-forward of the attention, MoE and residual cases."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class AttentionBlock(nn.Module):
    """A pre-norm transformer block around the case's own attention: ``x + attn(norm1(x))``, then
    ``x + down(gelu(up(norm2(x))))``."""

    def __init__(self, d: int, attn: nn.Module) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = attn
        self.norm2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class PreNormMLP(nn.Module):
    """``layers`` pre-norm MLP blocks of ``D_IN`` wide, a final LayerNorm and the output ``head``."""

    def __init__(self, hidden: int, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(PreNormBlock(D_IN, hidden) for _ in range(layers)))
        self.norm = nn.LayerNorm(D_IN)
        self.head = nn.Linear(D_IN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(x)))


class CaseTask(TaskBase):
    """A corpus case: ``make_model()`` builds the case's model (with an output Linear named ``head``);
    batches, teacher and loss are shared.

    ``rows`` × ``seq_len`` positions per batch; ``loss_weight``: the factor the mean squared error is
    multiplied by.
    """

    metrics = {"loss": "lower"}  # noqa: RUF012 - class constant
    rows: int = 16
    seq_len: int = 16
    loss_weight: float = 1.0
    head_shift: float = 0.7
    """How far the teacher's head is from the student's, in fresh initialisations: the fp32 loss starts near
    ``head_shift**2`` times the output's power and falls to a small fraction of it within 30 steps."""
    lr = 1e-2
    """The head's learning rate."""
    eps: float = 1e-8
    """AdamW's eps (its default)."""
    body_lr: float = 1e-3
    """The body's: a pre-trained body fine-tuned under a new head moves little in 30 steps, so what
    pre-training left in it (large weights, outliers, massive activations) is still there at the end."""
    preflight_batches: int = 1
    """How many of the task's first batches ``ampkit preflight`` replays for this case."""

    def __init__(self) -> None:
        self.samples_per_batch = self.rows
        self.tokens_per_batch = self.rows * self.seq_len

    def make_model(self) -> nn.Module:
        raise NotImplementedError

    def build_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return self.make_model()

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """AdamW (fused, as ``TaskBase``'s) with the head at ``lr`` and the rest at ``body_lr``."""
        head = {id(p) for p in model.get_submodule("head").parameters()}
        body = [p for p in model.parameters() if id(p) not in head]
        groups = [{"params": [p for p in model.parameters() if id(p) in head], "lr": self.lr},
                  {"params": body, "lr": self.body_lr}]
        return torch.optim.AdamW(groups, lr=self.lr, eps=self.eps, weight_decay=0.01, fused=True)

    def teacher(self, seed: int) -> nn.Module:
        """The model of ``seed`` with ``head_shift`` times a fresh head (drawn from ``seed + 1``) added to its
        head: what the student distils."""
        teacher = self.build_model(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)
            fresh = nn.Linear(teacher.head.in_features, teacher.head.out_features, bias=teacher.head.bias is not None)
        with torch.no_grad():
            for mine, shift in zip(teacher.head.parameters(), fresh.parameters(), strict=True):
                mine.add_(shift, alpha=self.head_shift)
        return teacher.requires_grad_(False)

    def inputs(self, gen: torch.Generator) -> torch.Tensor:
        return torch.randn(self.rows, self.seq_len, D_IN, generator=gen)

    def batches(self, seed: int, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self._stream(seed, seed, device)

    def _stream(self, seed: int, input_seed: int, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Inputs drawn from ``input_seed``, targets from the teacher of ``seed``."""
        teacher = self.teacher(seed)
        gen = torch.Generator().manual_seed(input_seed)
        while True:
            x = self.inputs(gen)
            with torch.no_grad(), torch.autocast("cpu", enabled=False):
                y = teacher(x)
            yield x.to(device), y.to(device)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(model(x).float(), y) * self.loss_weight

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        batch = next(self._stream(0, 10_000, device))  # the teacher of seed 0, on inputs no training batch has
        return {"loss": float(self.loss(model, batch))}  # one host read per evaluation


class RMSNorm(nn.Module):
    """RMSNorm as LLaMA and T5 write it (no mean subtraction, a learned gain)."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
