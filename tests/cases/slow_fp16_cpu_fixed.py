"""Fixed variant of slow_fp16_cpu.py: bf16 autocast on the CPU, no scaler needed."""
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
x_all, y_all = torch.randn(96, 48), torch.randint(0, 6, (96,))
model = nn.Sequential(nn.Linear(48, 96), nn.ReLU(), nn.Linear(96, 6))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(6):
    x, y = x_all[step * 16:(step + 1) * 16], y_all[step * 16:(step + 1) * 16]
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
