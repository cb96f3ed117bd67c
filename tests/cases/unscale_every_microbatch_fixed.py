"""Fixed variant of unscale_every_microbatch.py: unscale, log and update only at the accumulation boundary."""
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
    if (i + 1) % ACCUM == 0:
        scaler.unscale_(optimizer)
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item() * ACCUM:.4f} last grad norm {grad_norms[-1]:.3f}")
