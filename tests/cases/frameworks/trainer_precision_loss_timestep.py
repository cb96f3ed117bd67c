"""Toy diffusion denoiser trained by the stock Hugging Face Trainer with ``bf16=True`` on CPU.

Its timestep embedding projects the timestep (up to 1000) through a Linear that Accelerate's
autocast runs in bf16: a phase of several hundred radians keeps 8 significant bits, so sin/cos
of it are noise while every value stays finite.
"""
import math

import torch
from torch import nn
from torch.nn import functional as F
from transformers import Trainer, TrainingArguments


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


class Denoiser(nn.Module):
    def __init__(self, data_dim: int = 4, dim: int = 32) -> None:
        super().__init__()
        self.time = TimestepEmbedding(dim)
        self.inp = nn.Linear(data_dim, dim)
        self.out = nn.Sequential(nn.SiLU(), nn.Linear(dim, data_dim))

    def forward(self, xt: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> dict[str, torch.Tensor]:
        pred = self.out(self.inp(xt) + self.time(t))
        return {"loss": F.mse_loss(pred.float(), noise)}


class NoisedData(torch.utils.data.Dataset):
    def __init__(self, n: int = 32) -> None:
        g = torch.Generator().manual_seed(0)
        x0 = torch.randn(n, 4, generator=g) * 0.5 + 1.0
        self.t = torch.randint(500, 1000, (n,), generator=g)
        self.noise = torch.randn(n, 4, generator=g)
        a = torch.cumprod(1.0 - torch.linspace(1e-4, 0.02, 1000), 0)[self.t][:, None]
        self.xt = a.sqrt() * x0 + (1 - a).sqrt() * self.noise

    def __len__(self) -> int:
        return len(self.t)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"xt": self.xt[i], "t": self.t[i], "noise": self.noise[i]}


torch.manual_seed(0)
model = Denoiser()
args = TrainingArguments(output_dir="/tmp/ampkit-doctor-trainer", bf16=True, use_cpu=True, max_steps=4,
                         per_device_train_batch_size=8, learning_rate=1e-3, report_to=[], save_strategy="no",
                         logging_strategy="no", disable_tqdm=True)
Trainer(model=model, args=args, train_dataset=NoisedData()).train()
