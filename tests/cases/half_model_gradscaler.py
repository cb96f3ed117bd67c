"""Sentiment classifier converted with model.half() "to use mixed precision", plus a GradScaler.

The parameters themselves are fp16, so their gradients are fp16 too, and GradScaler refuses:
"Attempting to unscale FP16 gradients."  Mixed precision means fp32 weights with fp16 math.
"""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
embeddings, labels = torch.randn(64, 24), torch.randint(0, 2, (64,))
model = nn.Sequential(nn.Linear(24, 32), nn.ReLU(), nn.Linear(32, 2)).to(device).half()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4)
scaler = torch.amp.GradScaler(device)
for step in range(4):
    x, y = embeddings[step * 16:(step + 1) * 16].to(device).half(), labels[step * 16:(step + 1) * 16].to(device)
    loss = F.cross_entropy(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
