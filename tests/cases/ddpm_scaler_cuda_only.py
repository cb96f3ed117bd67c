"""A small DDPM trainer (noise prediction, sinusoidal time embedding, a two-level conv UNet)
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
num_timesteps, batch_size, train_steps, save_every = 100, 16, 6, 3
betas = torch.linspace(1e-4, 0.02, num_timesteps)
alphas_cumprod = torch.cumprod(1.0 - betas, dim=0).to(device)


def timestep_embedding(t, dim):
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class ResBlock(nn.Module):
    def __init__(self, ch, tdim):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(4, ch), nn.Conv2d(ch, ch, 3, padding=1)
        self.temb = nn.Linear(tdim, ch)
        self.norm2, self.conv2 = nn.GroupNorm(4, ch), nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x, temb):
        h = self.conv1(F.silu(self.norm1(x))) + self.temb(temb)[:, :, None, None]
        return x + self.conv2(F.silu(self.norm2(h)))


class TinyUNet(nn.Module):
    def __init__(self, ch=16, tdim=32):
        super().__init__()
        self.tdim = tdim
        self.time_mlp = nn.Sequential(nn.Linear(tdim, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        self.inc = nn.Conv2d(1, ch, 3, padding=1)
        self.down = nn.Conv2d(ch, 2 * ch, 3, stride=2, padding=1)
        self.mid = ResBlock(2 * ch, tdim)
        self.up = nn.ConvTranspose2d(2 * ch, ch, 2, stride=2)
        self.dec = ResBlock(ch, tdim)
        self.out = nn.Conv2d(ch, 1, 3, padding=1)

    def forward(self, x, t):
        temb = self.time_mlp(timestep_embedding(t, self.tdim))
        h1 = self.inc(x)
        h = self.mid(self.down(h1), temb)
        h = self.dec(self.up(h) + h1, temb)
        return self.out(h)


def sample_images(n):
    """8x8 images of bright squares at random places, scaled to [-1, 1]."""
    imgs = torch.full((n, 1, 8, 8), -1.0)
    corners = torch.randint(0, 5, (n, 2))
    for i, (r, c) in enumerate(corners.tolist()):
        imgs[i, :, r:r + 3, c:c + 3] = 1.0
    return imgs.to(device)


model = TinyUNet().to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-4)
scaler = torch.amp.GradScaler("cuda")
ckpt_dir = tempfile.mkdtemp(prefix="ddpm-")
for step in range(train_steps):
    x0 = sample_images(batch_size)
    t = torch.randint(0, num_timesteps, (batch_size,), device=device)
    noise = torch.randn_like(x0)
    a = alphas_cumprod[t].view(-1, 1, 1, 1)
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
