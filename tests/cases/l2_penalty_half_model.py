"""A model cast to fp16 with ``.half()`` (no autocast) and an explicit L2 penalty added to the loss:
the sum of squared weights over the model (about 2e5 here) exceeds fp16's 65504, so the penalty, and
the loss, are inf from the first step; the weights themselves are fp16, so even a finite step would
lose updates below their rounding step.
"""
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)).half()
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0.0, 1.0)  # a badly scaled initialisation: unit-variance weights
optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
inputs, targets = torch.randn(32, 256).half(), torch.randn(32, 256).half()
for step in range(4):
    x, y = inputs[step * 8:(step + 1) * 8], targets[step * 8:(step + 1) * 8]
    out = model(x)
    l2 = sum((p * p).sum() for p in model.parameters())
    loss = F.mse_loss(out.float(), y.float()) + 1e-4 * l2
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
