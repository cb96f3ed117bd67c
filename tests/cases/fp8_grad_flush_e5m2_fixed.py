"""Fixed variant of fp8_grad_flush_e5m2.py: the likelihood ratios are clipped to [1e-4, 1] (the usual
truncated importance weights), so every row of grad_output stays within e5m2's range under one scale."""
import torch
from torch import nn
from torch.nn import functional as F

import ampkit

torch.manual_seed(0)
x_all = torch.randn(256, 32)
y_all = torch.tanh(x_all[:, :16] * 2.0)
weights_all = (10.0 ** -(torch.rand(256) * 16.0)).clamp(min=1e-4)  # clipped ratios: 1 .. 1e-4

model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))
mp = ampkit.MixedPrecision("fp8", device="cpu")
model = mp.prepare(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for i in range(4):
    x, y, w = x_all[i * 64:(i + 1) * 64], y_all[i * 64:(i + 1) * 64], weights_all[i * 64:(i + 1) * 64]
    with mp.autocast():
        pred = model(x)
    loss = (w[:, None] * F.mse_loss(pred.float(), y, reduction="none")).sum() / w.sum()
    mp.backward(loss)
    mp.step(optimizer)
print(f"loss {loss.item():.4f}")
