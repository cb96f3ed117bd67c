"""Regression with gradient accumulation (fp16 + GradScaler) that logs the gradient norm of
every micro-batch.

To log a meaningful norm it calls scaler.unscale_() on each micro-batch, and then
scaler.update() so that the next unscale_ is allowed.  No error is raised, but the scale can
change inside the accumulation window and each micro-batch adds scaled gradients on top of
already unscaled ones: the accumulated gradient is a mix of different scales.
"""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
ACCUM = 4
torch.manual_seed(0)
x_all = torch.randn(128, 10)
y_all = x_all @ torch.randn(10, 1)

model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
scaler = torch.amp.GradScaler(device)
grad_norms = []
for i in range(16):
    x, y = x_all[i * 8:(i + 1) * 8].to(device), y_all[i * 8:(i + 1) * 8].to(device)
    with torch.autocast(device_type=device, dtype=torch.float16):
        loss = F.mse_loss(model(x), y) / ACCUM
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
    if (i + 1) % ACCUM == 0:
        scaler.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
    scaler.update()
print(f"loss {loss.item() * ACCUM:.4f} last grad norm {grad_norms[-1]:.3f}")
