"""Warm-up schedule with a fused AdamW, fixed: the scheduler steps only when the scale held.

Instead of a step post-hook (which fires on the steps fused AdamW discards), the loop compares
GradScaler's scale before and after update(): it backs off exactly on the skipped steps, so the
warm-up advances once per real update.
"""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
WARMUP = 8
torch.manual_seed(0)
# house prices in thousands: unnormalised targets make the scaled gradients overflow at first
x_all = torch.randn(160, 12)
y_all = 22.5 + 6.0 * x_all[:, :1] + 1.5 * torch.randn(160, 1)
model = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / WARMUP))
scaler = torch.amp.GradScaler(device)
skipped = 0
for step in range(10):
    x, y = x_all[step * 16:(step + 1) * 16].to(device), y_all[step * 16:(step + 1) * 16].to(device)
    with torch.autocast(device_type=device, dtype=torch.float16):
        loss = F.mse_loss(model(x).float(), y)
    scale = scaler.get_scale()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    skipped += scaler.get_scale() < scale
    if scaler.get_scale() >= scale:  # the scale did not back off: the update was applied
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
updates = int(optimizer.state[model[0].weight]["step"])
print(f"loss {loss.item():.1f} skipped {skipped} updates {updates} scheduler steps {scheduler.last_epoch}"
      f" lr {scheduler.get_last_lr()[0]:.2e}")
