"""Tabular regressor trained in fp8 (ampkit.MixedPrecision("fp8")) whose raw input carries one
"massive activation": a row-id column of about 1e6 next to features of order 1.

With tensorwise scaling the whole input of the first fp8 layer shares one scale, set by that
column: 448 / 1e6.  The features, four orders of magnitude smaller, land below e4m3's smallest
subnormal after scaling and flush to zero, so the layer sees only the id column (the pattern
of outlier channels that breaks tensorwise fp8 in LLMs, torchtitan #865 / pytorch/ao #3356).
"""
import torch
from torch import nn
from torch.nn import functional as F

import ampkit

torch.manual_seed(0)
features = torch.randn(256, 32)
features[:, 0] = torch.arange(256, dtype=torch.float32) * 4e3 + 1e6  # the id column, left in
target = features[:, 1:9].sum(dim=1, keepdim=True).repeat(1, 16)

model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))
with torch.no_grad():
    model[0].weight[:, 0] = 0.0
model[0].weight.register_hook(lambda g: g.index_fill(1, torch.tensor([0]), 0.0))  # the id is never read
mp = ampkit.MixedPrecision("fp8", device="cpu")
model = mp.prepare(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for i in range(4):
    x, y = features[i * 64:(i + 1) * 64], target[i * 64:(i + 1) * 64]
    with mp.autocast():
        pred = model(x)
    loss = F.mse_loss(pred.float(), y)
    mp.backward(loss)
    mp.step(optimizer)
print(f"loss {loss.item():.4f}")
