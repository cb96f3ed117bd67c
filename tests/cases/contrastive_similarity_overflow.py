"""A contrastive (InfoNCE) loss on unnormalised embeddings under fp16 autocast: the similarity
matrix ``z @ z.T`` is computed outside any module, and its entries (|z| ~ 200, 32 dims) exceed
fp16's 65504.

The logits are then shifted by their row maximum for stability, which turns ``inf - inf`` into NaN:
the loss is NaN although every encoder output is finite, and the first bad value is the matmul's inf.
"""
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
encoder = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32))
optimizer = torch.optim.SGD(encoder.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
views = torch.randn(48, 16) * 300
for step in range(6):
    x = views[step * 8:(step + 1) * 8]
    with torch.autocast("cpu", dtype=torch.float16):
        z = encoder(x)
        logits = z @ z.T  # unnormalised similarities
        logits = logits - logits.max(dim=-1, keepdim=True).values
        loss = F.cross_entropy(logits.float(), torch.arange(8))
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
