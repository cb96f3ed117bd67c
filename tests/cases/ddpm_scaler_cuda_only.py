"""A toy DDPM trainer (a 2-D spiral, an MLP noise predictor with a sinusoidal time embedding)
written on a GPU and run on a CPU-only machine.

Autocast follows the device (`device.type`), but the GradScaler is built as
`torch.amp.GradScaler("cuda")`, the spelling torch's deprecation warning suggests. Without CUDA
torch disables it with one warning: the fp16 forward on the CPU trains without loss scaling.
The periodic checkpoint holds the model and the optimizer but not the scaler: harmless while
the scaler is off, but on a GPU every resume would restart at the initial scale.
"""
import math
import os
import tempfile

import torch
from torch import nn
from torch.nn import functional as F

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
num_timesteps, batch_size, train_steps, save_every = 100, 128, 6, 3
betas = torch.linspace(1e-4, 0.02, num_timesteps)
alphas_cumprod = torch.cumprod(1.0 - betas, dim=0).to(device)


def timestep_embedding(t, dim):
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class Denoiser(nn.Module):
    def __init__(self, hidden=128, tdim=32):
        super().__init__()
        self.tdim = tdim
        self.time_mlp = nn.Sequential(nn.Linear(tdim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.inp = nn.Linear(2, hidden)
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, hidden), nn.SiLU()) for _ in range(3)])
        self.out = nn.Linear(hidden, 2)

    def forward(self, x, t):
        h = self.inp(x) + self.time_mlp(timestep_embedding(t, self.tdim))
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def sample_spiral(n):
    """Points on a noisy 2-D spiral, scaled to about [-1, 1]."""
    theta = math.pi / 2 + 3 * math.pi * torch.rand(n)
    points = torch.stack([theta * torch.cos(theta), theta * torch.sin(theta)], dim=1) / 10.0
    return (points + 0.02 * torch.randn(n, 2)).to(device)


model = Denoiser().to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cuda")
ckpt_dir = tempfile.mkdtemp(prefix="ddpm-")
for step in range(train_steps):
    x0 = sample_spiral(batch_size)
    t = torch.randint(0, num_timesteps, (batch_size,), device=device)
    noise = torch.randn_like(x0)
    a = alphas_cumprod[t].view(-1, 1)
    xt = a.sqrt() * x0 + (1.0 - a).sqrt() * noise
    with torch.autocast(device_type=device.type, dtype=torch.float16):
        pred = model(xt, t)
        loss = F.mse_loss(pred.float(), noise)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    if (step + 1) % save_every == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                   os.path.join(ckpt_dir, "last.pt"))
print(f"step {train_steps}: loss {loss.item():.4f}")
