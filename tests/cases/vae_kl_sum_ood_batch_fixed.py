"""Fixed twin: the KL is summed in fp32. Source: NVIDIA/apex issue #812 (a VAE's KL term "blows up" in fp16) with the summed KL of
wiseodd/generative-models issue #40, ``0.5 * sum(exp(logvar) + mu ** 2 - 1 - logvar)``.

A VAE on sensor windows trained under fp16 autocast with a GradScaler. The encoder's ``mu`` and
``logvar`` are fp16, and so is the KL term summed over the batch's latents (log-variances clamped
at 10, so that each exp(logvar) stays finite). Ordinary windows encode near the origin and the sum
is a few dozen; the fifth batch is a recording made with the gain misconfigured (values 16 times
larger), whose log-variances reach the clamp: each exp(logvar) is finite (22026), their sum over
the batch passes 65504. That batch's loss is inf; the others are clean.
"""
import torch
from torch import nn
from torch.nn import functional as F


class VAE(nn.Module):
    def __init__(self, dim=24, latent=32):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, 2 * latent))
        self.dec = nn.Sequential(nn.Linear(latent, 64), nn.ReLU(), nn.Linear(64, dim))

    def forward(self, x):
        mu, logvar = self.enc(x).chunk(2, dim=-1)
        logvar = logvar.clamp(-10.0, 10.0)  # exp(logvar) stays finite
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        return self.dec(z), mu, logvar


torch.manual_seed(0)
vae = VAE()
optimizer = torch.optim.Adam(vae.parameters(), lr=1e-4)
scaler = torch.amp.GradScaler("cpu")
windows = torch.randn(6, 32, 24)
windows[4] *= 16.0  # gain misconfigured for one recording

for step in range(6):
    x = windows[step]
    with torch.autocast("cpu", dtype=torch.float16):
        recon, mu, logvar = vae(x)
        mu, logvar = mu.float(), logvar.float()
        kl = 0.5 * torch.sum(logvar.exp() + mu ** 2 - 1.0 - logvar) / len(x)
        loss = F.mse_loss(recon, x) + 1e-3 * kl
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():g}")
