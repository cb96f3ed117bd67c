"""MNIST-style MLP classifier with fp16 autocast, a GradScaler and gradient clipping.

The gradients are clipped right after backward, while they still hold loss x 65536: the
norm is measured in scaled units, so clip_grad_norm_(max_norm=1.0) clips every step far
harder than intended.
"""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
images = torch.rand(256, 1, 14, 14)
labels = (images.mean(dim=(1, 2, 3)) * 10).long().clamp(max=9)

model = nn.Sequential(nn.Flatten(), nn.Linear(196, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
scaler = torch.amp.GradScaler(device)

for step in range(8):
    x, y = images[step * 32:(step + 1) * 32].to(device), labels[step * 32:(step + 1) * 32].to(device)
    with torch.autocast(device_type=device, dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
