"""Transformer-style warm-up schedule with fp16 autocast and a GradScaler started at 2**24.

The scaler starts high "to be safe from underflow", so its first steps overflow and are
skipped while the scale falls.  The LR scheduler is stepped unconditionally every iteration:
the warm-up advances on steps that never updated the weights.
"""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
WARMUP = 6
torch.manual_seed(0)
x_all, y_all = torch.randn(160, 20), torch.randint(0, 4, (160,))
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / WARMUP))
scaler = torch.amp.GradScaler(device, init_scale=2.0**24)
for step in range(10):
    x, y = x_all[step * 16:(step + 1) * 16].to(device), y_all[step * 16:(step + 1) * 16].to(device)
    with torch.autocast(device_type=device, dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e}")
