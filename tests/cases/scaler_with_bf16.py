"""A small CNN trained with bf16 autocast and, out of habit from fp16 recipes, a GradScaler.

bf16 has the exponent range of fp32: gradients do not underflow, so the scaler only adds
work (and skipped steps whenever the scale overshoots).
"""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
images, labels = torch.randn(64, 1, 12, 12), torch.randint(0, 4, (64,))
model = nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 10 * 10, 4)).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler(device)
for step in range(6):
    x, y = images[step * 8:(step + 1) * 8].to(device), labels[step * 8:(step + 1) * 8].to(device)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
