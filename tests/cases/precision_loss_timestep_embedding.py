"""Toy diffusion denoiser (epsilon prediction) whose timestep embedding uses learned Fourier
frequencies: phase = Linear(1 -> 16)(t), then sin and cos.  Trained with bf16 autocast and
timesteps up to 1000.

The frequency projection is a Linear, so autocast runs it in bf16: a phase of several hundred
radians keeps 8 significant bits, a spacing of 2 to 4 radians, and sin/cos of it are noise.
Nothing overflows and the projection's own output is within 0.5 % of fp32; the embedding that
every denoiser layer is conditioned on is garbage, and so is the predicted noise.
"""
import math

import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        half = dim // 2
        self.freq = nn.Linear(1, half, bias=False)
        with torch.no_grad():  # transformer frequencies, learnable afterwards
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

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.out(self.inp(x) + self.time(t))


torch.manual_seed(0)
data = torch.randn(64, 4) * 0.5 + 1.0
betas = torch.linspace(1e-4, 0.02, 1000)
alpha_bar = torch.cumprod(1.0 - betas, dim=0)
model = Denoiser().to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(8):
    x0 = data[step * 8:(step + 1) * 8]
    t = torch.randint(500, 1000, (8,))
    noise = torch.randn_like(x0)
    a = alpha_bar[t][:, None]
    xt = (a.sqrt() * x0 + (1 - a).sqrt() * noise).to(device)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        pred = model(xt, t.to(device))
    loss = F.mse_loss(pred.float(), noise.to(device))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
