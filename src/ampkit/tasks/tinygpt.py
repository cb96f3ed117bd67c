"""``tinygpt``: the byte-level GPT learning Python from the standard library's own source.

Data: the top-level ``*.py`` files of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``), in sorted order.  Every 8th file is held out for
evaluation; the rest is concatenated into the training byte stream.  No download, no tokenizer:
bytes are the vocabulary.  The file list differs between Python versions, so the task records a
fingerprint of it (``describe()``) and reports compare only runs with equal fingerprints.

Training batches are random windows drawn with a ``torch.Generator`` seeded by the run's seed,
so every precision sees the same windows in the same order.  Evaluation is the mean next-byte
cross-entropy in **bits per byte** (lower is better) on fixed, evenly spaced windows of the
held-out files.

Sizes: the default (``full``: d_model 256, 4 layers, 256-byte context, batch 16 = 4096 tokens
per step) makes the step matmul-bound, so bf16's speed-up on a CPU with AVX512-BF16/AMX is
visible; its 200 steps take one to two minutes per precision on 2 cores.  Where
bf16 is emulated (AVX2-only CPUs, about 0.03x fp32) one such step takes 15-30 s, so
``ampkit verify --time-budget`` may run a smaller rung of the ladder ``SIZES``; each rung's
step count is the one at which two fp32 runs with different data orders agree closely enough
for verify's default tolerances (the fp32 noise band, docs/verify.md).
"""

from __future__ import annotations

import functools
import hashlib
import math
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampkit.tasks.base import TaskBase, TaskSize
from ampkit.tasks.gpt import GPT, GPTConfig

__all__ = ["SIZES", "StdlibCorpus", "TinyGPTTask", "stdlib_corpus"]

HOLDOUT_EVERY = 8
"""Every 8th file of the sorted list is held out for evaluation (12.5 %)."""


class StdlibCorpus:
    """Training and held-out bytes from the standard library's top-level source files."""

    def __init__(self, root: Path) -> None:
        files = sorted(p for p in root.glob("*.py") if p.is_file())
        if len(files) < 2 * HOLDOUT_EVERY:
            raise RuntimeError(
                f"the standard library at {str(root)!r} holds only {len(files)} top-level .py files; tinygpt "
                "needs the interpreter's source files (some minimal Python builds ship only .pyc)"
            )
        self.root = root
        self.eval_files = [p for i, p in enumerate(files) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
        self.train_files = [p for i, p in enumerate(files) if i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]
        digest = hashlib.sha256()
        for p in files:
            digest.update(f"{p.name}\0{p.stat().st_size}\n".encode())
        self.fingerprint = digest.hexdigest()[:16]
        self.train = self._read(self.train_files)
        self.eval = self._read(self.eval_files)

    @staticmethod
    def _read(files: list[Path]) -> torch.Tensor:
        # Files are separated by a NUL byte so no window pretends two files are one.
        data = b"\0".join(p.read_bytes() for p in files)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@functools.cache
def stdlib_corpus() -> StdlibCorpus:
    """The corpus of this interpreter (read once per process, about 5 MB)."""
    return StdlibCorpus(Path(sysconfig.get_paths()["stdlib"]))


@dataclass(frozen=True)
class _Rung:
    d_model: int
    n_layer: int
    n_head: int
    block_size: int
    eval_windows: int
    steps: int
    lr: float


SIZES: dict[str, _Rung] = {
    # Largest first, batch 16 everywhere, lr 1e-3: at 2e-3 the fp32 curves of two data orders
    # drift 1.3-6.4% apart (small) and 4.6% (full), with a worse final loss.  The small rungs' steps
    # are where the fp32 noise band of 3-4 data-order seeds stayed within a third of verify's
    # tolerances (3% loss distance, 2% metric); docs/verify.md has the figures.  More held-out
    # windows on the small rungs: they are cheap there, and a larger sample steadies the metric.
    "full": _Rung(256, 4, 4, 256, 64, 200, 1e-3),
    "small": _Rung(128, 2, 4, 64, 256, 200, 1e-3),
    "tiny": _Rung(64, 2, 2, 64, 256, 200, 1e-3),
}
BATCH_SIZE = 16


class TinyGPTTask(TaskBase):
    """Byte-level GPT on the standard library's source; metric ``bits_per_byte`` (lower is better)."""

    name = "tinygpt"
    metrics = {"bits_per_byte": "lower"}  # noqa: RUF012 - class constant
    default_steps = 200
    default_warmup = 10
    default_eval_every = 50
    lr = 1e-3
    clip_grad_norm = 1.0
    """GPT practice: clipping the unscaled global norm keeps early loss spikes from derailing a short run."""

    def __init__(self, *, d_model: int = 256, n_layer: int = 4, n_head: int = 4, block_size: int = 256,
                 batch_size: int = BATCH_SIZE, eval_windows: int = 64) -> None:
        self.config = GPTConfig(d_model=d_model, n_layer=n_layer, n_head=n_head, block_size=block_size)
        self.batch_size = batch_size
        self.eval_windows = eval_windows
        self.samples_per_batch = batch_size
        self.tokens_per_batch = batch_size * block_size
        self.size = next((name for name, r in SIZES.items() if self._is(r)), None)
        """The rung of ``SIZES`` this task is (None: a custom shape, which has no ladder)."""

    def _is(self, r: _Rung) -> bool:
        c = self.config
        return ((c.d_model, c.n_layer, c.n_head, c.block_size, self.eval_windows, self.batch_size) ==
                (r.d_model, r.n_layer, r.n_head, r.block_size, r.eval_windows, BATCH_SIZE))

    @classmethod
    def resized(cls, name: str) -> TinyGPTTask:
        """The task at rung ``name`` of ``SIZES``, with that rung's steps and learning rate."""
        if name not in SIZES:
            raise ValueError(f"tinygpt has no size {name!r}; its sizes: {', '.join(SIZES)}")
        r = SIZES[name]
        task = cls(d_model=r.d_model, n_layer=r.n_layer, n_head=r.n_head, block_size=r.block_size,
                   eval_windows=r.eval_windows)
        task.default_steps, task.lr = r.steps, r.lr
        return task

    @property
    def sizes(self) -> tuple[TaskSize, ...]:
        """The ladder, largest first (empty for a custom shape)."""
        if self.size is None:
            return ()
        return tuple(TaskSize(name, r.steps, _step_flops(r), f"d_model {r.d_model}, {r.n_layer} layers, "
                              f"{r.n_head} heads, context {r.block_size}") for name, r in SIZES.items())

    def describe(self) -> dict[str, Any]:
        corpus = stdlib_corpus()
        return {
            "model": f"GPT d_model={self.config.d_model} n_layer={self.config.n_layer} "
                     f"n_head={self.config.n_head} block_size={self.config.block_size}",
            "data": f"{len(corpus.train_files)} training / {len(corpus.eval_files)} held-out stdlib files "
                    f"({corpus.train.numel()} / {corpus.eval.numel()} bytes) from {corpus.root}",
            "data_fingerprint": corpus.fingerprint,
            "batch_size": self.batch_size,
            "size": self.size or "custom",
            "lr": self.lr,
        }

    def build_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return GPT(self.config)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        fused = next(model.parameters()).device.type in ("cpu", "cuda")
        return torch.optim.AdamW(model.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)

    def batches(self, seed: int, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        data = stdlib_corpus().train
        t = self.config.block_size
        gen = torch.Generator().manual_seed(seed)
        offsets = torch.arange(t + 1)
        while True:
            starts = torch.randint(0, data.numel() - t - 1, (self.batch_size, 1), generator=gen)
            window = data[starts + offsets].long()
            window = window.to(device, non_blocking=True)
            yield window[:, :-1], window[:, 1:]

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return GPT.loss(model(x), y)

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        data = stdlib_corpus().eval
        t = self.config.block_size
        starts = torch.linspace(0, data.numel() - t - 2, self.eval_windows).long()
        windows = data[starts[:, None] + torch.arange(t + 1)].long().to(device)
        total = torch.zeros((), dtype=torch.float64, device=device)
        for chunk in windows.split(self.batch_size):
            logits = model(chunk[:, :-1])
            total += GPT.loss(logits, chunk[:, 1:]).double() * chunk.shape[0]
        nats = float(total) / windows.shape[0]  # one host sync per evaluation
        return {"bits_per_byte": nats / math.log(2)}


def _step_flops(r: _Rung) -> float:
    """Training FLOPs of one step: 6 per parameter per token for the matmuls (forward and backward)
    plus the attention scores, 6 x layers x context x width per token (the usual transformer count)."""
    vocab = 256
    params = 12 * r.n_layer * r.d_model ** 2 + vocab * r.d_model
    per_token = 6 * params + 6 * r.n_layer * r.block_size * r.d_model
    return float(per_token * BATCH_SIZE * r.block_size)
