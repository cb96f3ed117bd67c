"""Patch denoiser trained with fp16 autocast and a GradScaler.  The loop unscales and clips, and
skips the update of a batch whose gradient norm spikes, with `continue`, as LVSM's trainer did.

The skip jumps over scaler.update() as well as scaler.step(): the scaler keeps this optimizer
marked as unscaled, and the next iteration's scaler.unscale_(optimizer) raises "unscale_() has
already been called on this optimizer since the last update()".  A batch of saturated patches
(the fifth batch) triggers the skip; the error is raised on the next batch.
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
    if grad_norm > SKIP_NORM:                          # a spike: drop this batch
        optimizer.zero_grad(set_to_none=True)
        continue
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():.0f}")
