"""An MLP trained on the CPU with fp16 autocast, copied from a GPU recipe.

Most CPUs have no fp16 matrix units: fp16 matmuls are emulated and run many times slower than
fp32, so "mixed precision" makes this run slower, not faster.  (bf16 has native units on
recent x86 CPUs.)
"""
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
x_all, y_all = torch.randn(96, 48), torch.randint(0, 6, (96,))
model = nn.Sequential(nn.Linear(48, 96), nn.ReLU(), nn.Linear(96, 6))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(6):
    x, y = x_all[step * 16:(step + 1) * 16], y_all[step * 16:(step + 1) * 16]
    with torch.autocast(device_type="cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
