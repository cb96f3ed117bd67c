"""Toy diffusion denoiser trained by a stock Lightning Trainer with ``precision="bf16-mixed"`` on CPU.

The precision plugin enters bf16 autocast around ``training_step``; the timestep embedding's
frequency projection then runs in bf16, where a phase of several hundred radians keeps 8
significant bits: sin/cos of it are noise while every value stays finite.
"""
import math

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        half = dim // 2
        self.freq = nn.Linear(1, half, bias=False)
        with torch.no_grad():
            self.freq.weight.copy_(torch.exp(-math.log(10000.0) * torch.arange(half) / half)[:, None])
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        phase = self.freq(t[:, None].float())
        return self.mlp(torch.cat([phase.sin(), phase.cos()], dim=-1))


class Denoiser(pl.LightningModule):
    def __init__(self, data_dim: int = 4, dim: int = 32) -> None:
        super().__init__()
        self.time = TimestepEmbedding(dim)
        self.inp = nn.Linear(data_dim, dim)
        self.out = nn.Sequential(nn.SiLU(), nn.Linear(dim, data_dim))

    def forward(self, xt: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.out(self.inp(xt) + self.time(t))

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        xt, t, noise = batch
        return F.mse_loss(self(xt, t).float(), noise)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


g = torch.Generator().manual_seed(0)
x0 = torch.randn(32, 4, generator=g) * 0.5 + 1.0
t = torch.randint(500, 1000, (32,), generator=g)
noise = torch.randn(32, 4, generator=g)
a = torch.cumprod(1.0 - torch.linspace(1e-4, 0.02, 1000), 0)[t][:, None]
data = torch.utils.data.TensorDataset(a.sqrt() * x0 + (1 - a).sqrt() * noise, t, noise)

torch.manual_seed(0)
model = Denoiser()
trainer = pl.Trainer(accelerator="cpu", precision="bf16-mixed", max_steps=4, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
