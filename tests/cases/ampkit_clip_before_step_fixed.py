"""House-price regressor trained with ampkit.MixedPrecision in fp16, two micro-batches per step.

Fixed: the engine clips (clip_grad_norm=1.0), after it unscales the gradients inside mp.step().
"""
import torch
from torch import nn
from torch.nn import functional as F

import ampkit

torch.manual_seed(0)
features = torch.randn(192, 12)
prices = features @ torch.linspace(-1.0, 1.0, 12) + 0.1 * torch.randn(192)

model = nn.Sequential(nn.Linear(12, 48), nn.GELU(), nn.Linear(48, 48), nn.GELU(), nn.Linear(48, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
mp = ampkit.MixedPrecision("fp16", device="cpu", grad_accumulation=2, clip_grad_norm=1.0)
mp.prepare(model)

for i in range(12):
    x, y = features[i * 16:(i + 1) * 16], prices[i * 16:(i + 1) * 16]
    with mp.autocast():
        pred = model(x).squeeze(-1)
    loss = F.mse_loss(pred.float(), y)
    mp.backward(loss)
    mp.step(optimizer)
print(f"loss {loss.item():.4f}")
