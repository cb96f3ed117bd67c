"""Small models with known precision failures, shared by the doctor tests (fp16 models stay tiny:
fp16 has no fast path on this CPU)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from ampkit._util.frames import UserFrames
from ampkit.diagnose.core.modules import ModuleRecorder
from ampkit.diagnose.step.trace import OpTracer, TraceLog


class RMSNorm(nn.Module):
    """A hand-written RMSNorm without the fp32 upcast: x*x overflows fp16 once |x| > 256."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = (x * x).mean(-1, keepdim=True)  # LINE: rmsnorm-square
        return x * torch.rsqrt(var + 1e-6) * self.weight


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = RMSNorm(d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(self.norm(self.fc(x)))


class NormNet(nn.Module):
    """Blocks of Linear -> RMSNorm -> Linear; ``hot`` blocks get weights that overflow the norm."""

    def __init__(self, d: int = 16, n: int = 2, hot: tuple[int, ...] = (1,)) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 1)
        with torch.no_grad():
            for i in hot:
                self.blocks[i].fc.weight.mul_(300.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Attention(nn.Module):
    """Self-attention written out by hand; ``scale_first`` divides q by sqrt(d) before the matmul."""

    def __init__(self, d: int, scale_first: bool = False) -> None:
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.scale_first = scale_first

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        d = q.shape[-1]
        if self.scale_first:
            q = q / math.sqrt(d)
        scores = q @ k.transpose(-2, -1)  # LINE: attention-logits
        if not self.scale_first:
            scores = scores / math.sqrt(d)
        if mask is not None:
            scores = scores + mask
        return torch.softmax(scores, dim=-1) @ v


class AttnNet(nn.Module):
    def __init__(self, d: int = 8, scale_first: bool = False) -> None:
        super().__init__()
        self.attn = Attention(d, scale_first)
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.attn(x, mask))


class MaskedAttnNet(nn.Module):
    """Adds a causal and a padding mask, each filled with fp16's most negative finite value."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.attn = MaskedAttention(d)
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(self.proj(x), pad))


class MaskedAttention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qk = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        scores = self.qk(x) @ x.transpose(-2, -1)
        lowest = torch.finfo(scores.dtype).min
        causal = torch.triu(torch.full((t, t), lowest, dtype=scores.dtype), diagonal=1)
        padding = pad[:, None, :].to(scores.dtype) * lowest
        mask = causal + padding  # LINE: mask-sum
        return torch.softmax(scores + mask, dim=-1) @ x


class PairDistance(nn.Module):
    """Pairwise distances of learned 3-d points with an epsilon that is 0 in fp16: sqrt(0) on the diagonal."""

    def __init__(self, d_in: int = 4) -> None:
        super().__init__()
        self.points = nn.Linear(d_in, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.points(x)
        d = p[:, None, :] - p[None, :, :]
        return torch.sqrt((d * d).sum(-1) + 1e-8)  # LINE: pair-sqrt


def line_of(path: str, tag: str) -> int:
    """The line number of the source line carrying ``# LINE: tag``."""
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if f"# LINE: {tag}" in line:
                return i
    raise LookupError(tag)


def fp16_run(x: torch.Tensor, *extra: torch.Tensor):
    def run(model: nn.Module) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x, *extra)
        return out.float().pow(2).mean()

    return run


def bf16_run(x: torch.Tensor, *extra: torch.Tensor):
    def run(model: nn.Module) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x, *extra)
        return out.float().pow(2).mean()

    return run


class Fn(nn.Module):
    """Runs ``fn`` as a module forward, so the tracer attributes its ops to module ""."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return self.fn(*xs)


def trace_fn(fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> TraceLog:
    """The op trace of ``fn(*xs)`` run as the forward of a parameterless module."""
    model = Fn(fn)
    with ModuleRecorder(model, stats=False) as rec:
        tracer = OpTracer(model, rec, user_frames=UserFrames([fn.__code__.co_filename]))
        with tracer:
            model(*xs)
        tracer.finalize()
    return TraceLog.from_tracer(tracer)
