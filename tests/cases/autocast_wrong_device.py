"""A GPU training script run on a machine without a GPU: the device falls back to the CPU, but
autocast and the GradScaler were written for "cuda".

On a CPU-only machine torch disables both (with a warning that scrolls by): the model trains in
fp32 while the script believes it uses mixed precision.
"""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
signals, labels = torch.randn(64, 32), torch.randint(0, 2, (64,))
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 2)).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cuda")
for step in range(4):
    x, y = signals[step * 16:(step + 1) * 16].to(device), labels[step * 16:(step + 1) * 16].to(device)
    with torch.autocast(device_type="cuda", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
