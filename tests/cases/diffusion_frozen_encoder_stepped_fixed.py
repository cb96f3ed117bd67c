"""Fixed variant of diffusion_frozen_encoder_stepped.py: the label encoder's optimizer steps only
once the encoder is trained (after FREEZE_STEPS)."""
import contextlib
import math

import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
FREEZE_STEPS, T = 2, 100


def time_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    freqs = torch.exp(-math.log(10000.0) * torch.arange(dim // 2, device=t.device) / (dim // 2))
    angles = t.float()[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


class Denoiser(nn.Module):
    def __init__(self, d: int = 8, hidden: int = 64) -> None:
        super().__init__()
        self.time = nn.Sequential(nn.Linear(16, hidden), nn.SiLU())
        self.net = nn.Sequential(nn.Linear(d + hidden, hidden), nn.SiLU(), nn.Linear(hidden, d))

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        h = self.time(time_embedding(t, 16)) + cond
        return self.net(torch.cat([x, h], dim=1))


denoiser = Denoiser().to(device)
encoder = nn.Embedding(4, 64).to(device)
opt_denoiser = torch.optim.AdamW(denoiser.parameters(), lr=1e-3)
opt_encoder = torch.optim.AdamW(encoder.parameters(), lr=1e-4)
scaler = torch.amp.GradScaler(device)
alphas = torch.cos(torch.linspace(0, math.pi / 2, T)) ** 2

for step in range(4):
    labels = torch.randint(0, 4, (16,), device=device)
    x0 = torch.randn(16, 8, device=device) + labels[:, None].float()
    t = torch.randint(0, T, (16,), device=device)
    noise = torch.randn_like(x0)
    a = alphas.to(device)[t][:, None]
    xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
    frozen = torch.no_grad() if step < FREEZE_STEPS else contextlib.nullcontext()
    with torch.autocast(device_type=device, dtype=torch.float16):
        with frozen:
            cond = encoder(labels)
        loss = F.mse_loss(denoiser(xt, t, cond).float(), noise)
    scaler.scale(loss).backward()
    scaler.step(opt_denoiser)
    if step >= FREEZE_STEPS:
        scaler.step(opt_encoder)
    scaler.update()
    opt_denoiser.zero_grad(set_to_none=True)
    opt_encoder.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
