"""Importance-weighted regression trained in fp8 (tensorwise): the per-sample loss weights are
likelihood ratios that span 16 orders of magnitude (1 down to 1e-16).

The gradient arriving at each fp8 layer (grad_output) carries those weights row by row, and
tensorwise scaling casts it to e5m2 with one scale for the whole tensor: the rows weighted below
about 1e-10 of the largest fall under e5m2's smallest subnormal and are flushed to zero, so
those samples stop training the network (gradients flushed in fp8's backward format,
TransformerEngine #841 and similar reports).
"""
import torch
from torch import nn
from torch.nn import functional as F

import ampkit

torch.manual_seed(0)
x_all = torch.randn(256, 32)
y_all = torch.tanh(x_all[:, :16] * 2.0)
weights_all = 10.0 ** -(torch.rand(256) * 16.0)  # likelihood ratios, 1 .. 1e-16

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
