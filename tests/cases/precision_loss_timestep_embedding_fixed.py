"""Fixed variant of precision_loss_timestep_embedding.py: the phase t * freq is computed in fp32
(autocast off for the frequency projection); sin and cos then see the exact phase."""
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
        with torch.autocast(device_type=t.device.type, enabled=False):  # phases of ~1000 rad need fp32
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
