"""Fixed variant of fp8_activation_outlier.py: the first layer, whose input holds the id column, is kept
out of fp8 (fp8_filter=["0"], as the doctor verified); the other layers train in fp8."""
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
mp = ampkit.MixedPrecision("fp8", device="cpu", fp8_filter=["0"])  # the layer that reads the raw id column
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
