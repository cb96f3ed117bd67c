"""A small MLP trained with ampkit.MixedPrecision("fp8") on a CPU whose bf16 matmuls are fast.

The CPU has no fp8 matrix units: torchao's fp8 layers run torch's CPU _scaled_mm, many times
slower than the bf16 matmul the same layers would run without fp8.  fp8 on a CPU checks fp8's
numerics; it cannot make training faster (the doctor reports it as information).
"""
import torch
from torch import nn
from torch.nn import functional as F

import ampkit

torch.manual_seed(0)
x_all, y_all = torch.randn(128, 32), torch.randn(128, 16)
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
mp = ampkit.MixedPrecision("fp8", device="cpu")
model = mp.prepare(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for i in range(2):
    with mp.autocast():
        pred = model(x_all[i * 64:(i + 1) * 64])
    loss = F.mse_loss(pred.float(), y_all[i * 64:(i + 1) * 64])
    mp.backward(loss)
    mp.step(optimizer)
print(f"loss {loss.item():.4f}")
