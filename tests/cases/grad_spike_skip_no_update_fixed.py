"""Fixed twin of grad_spike_skip_no_update.py.

A spiking batch only drops its gradients (zero_grad); scaler.step() and scaler.update() still run
on every iteration, so the scaler's per-optimizer state is reset and the next unscale_() is legal
(with no gradients, the optimizer leaves the weights alone).
"""
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
B, P = 16, 64
MAX_NORM, SKIP_NORM = 1.0, 10.0

model = nn.Sequential(nn.Linear(P, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, P))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
clean = torch.rand(8 * B, P)
clean[4 * B:5 * B] *= 30.0                           # one batch of over-exposed patches
noisy = clean + 0.1 * torch.randn_like(clean)
for step in range(8):
    x, y = noisy[step * B:(step + 1) * B], clean[step * B:(step + 1) * B]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    if grad_norm > SKIP_NORM:                          # a spike: drop this batch's gradients
        optimizer.zero_grad(set_to_none=True)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():.0f}")
