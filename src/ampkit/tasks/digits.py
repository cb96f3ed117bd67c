"""``digits``: a small conv net on scikit-learn's bundled handwritten digits (accuracy, higher is better).

Data: ``sklearn.datasets.load_digits`` (1797 8×8 grey images, shipped inside scikit-learn, no
download), scaled to [0, 1].  Every 5th image (by index) is held out: 360 test images, 1437 for
training.  Batches are random draws without replacement per epoch from a seeded
``torch.Generator``, so every precision sees the same order.

The net upsamples to 16×16 and runs three 3×3 convolutions (64-128-128 channels) before a
linear classifier, so most of the time goes to convolution GEMMs that bf16 accelerates.
scikit-learn is the optional extra ``ampkit[digits]``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ampkit.tasks.base import TaskBase

__all__ = ["DigitsNet", "DigitsTask", "load_digits_tensors"]

HOLDOUT_EVERY = 5


@functools.cache
def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train_x, train_y, test_x, test_y) as float32 [N, 1, 8, 8] images in [0, 1] and int64 labels."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError(
            "the 'digits' task needs scikit-learn, which ships the dataset; install it with "
            "`pip install 'ampkit[digits]'` (or `pip install scikit-learn`)"
        ) from exc
    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.long)
    held = torch.arange(len(y)) % HOLDOUT_EVERY == HOLDOUT_EVERY - 1
    return x[~held], y[~held], x[held], y[held]


class DigitsNet(nn.Module):
    """Conv(64)-Conv(128)-pool-Conv(128)-pool-Linear on 16×16 upsampled digits."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.conv3 = nn.Conv2d(2 * width, 2 * width, 3, padding=1)
        self.norm = nn.GroupNorm(8, 2 * width)
        self.head = nn.Linear(2 * width * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(x, scale_factor=2.0, mode="bilinear", align_corners=False)
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.max_pool2d(F.relu(self.norm(self.conv3(x))), 2)
        return self.head(x.flatten(1))


class DigitsTask(TaskBase):
    """Handwritten-digit classification; metric ``accuracy`` on 360 held-out images."""

    name = "digits"
    # Accuracy only: the held-out cross-entropy of a classifier this good is ~0.01, and a relative
    # change of a number that small says nothing (two fp32 seeds differ by 2x).
    metrics = {"accuracy": "higher"}  # noqa: RUF012 - class constant
    default_steps = 300
    default_warmup = 20
    default_eval_every = 100
    lr = 2e-3

    def __init__(self, *, batch_size: int = 64, width: int = 64) -> None:
        load_digits_tensors()  # fail at load time, with the install hint, when scikit-learn is missing
        self.batch_size = batch_size
        self.width = width
        self.samples_per_batch = batch_size
        self.tokens_per_batch = None

    def describe(self) -> dict[str, Any]:
        train_x, _, test_x, _ = load_digits_tensors()
        return {
            "model": f"DigitsNet width={self.width}",
            "data": f"sklearn load_digits: {len(train_x)} training / {len(test_x)} held-out images",
            "batch_size": self.batch_size,
        }

    def build_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return DigitsNet(self.width)

    def batches(self, seed: int, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        x, y, _, _ = load_digits_tensors()
        x, y = x.to(device), y.to(device)
        gen = torch.Generator().manual_seed(seed)
        while True:
            order = torch.randperm(len(y), generator=gen)
            for i in range(0, len(order) - self.batch_size + 1, self.batch_size):
                idx = order[i : i + self.batch_size].to(device)
                yield x[idx], y[idx]

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x).float(), y)

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        _, _, x, y = load_digits_tensors()
        logits = model(x.to(device)).float()
        y = y.to(device)
        return {"accuracy": float((logits.argmax(1) == y).double().mean())}  # one host sync per evaluation
