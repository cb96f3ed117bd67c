"""Fixed variant of scaler_without_autocast.py: the --amp switch controls the GradScaler too."""
import argparse

import torch
from torch import nn
from torch.nn import functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--amp", action="store_true", help="train with fp16 mixed precision")
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
x_all, y_all = torch.randn(64, 10), torch.randint(0, 2, (64,))
model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 2)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler(device, enabled=args.amp)
for step in range(4):
    x, y = x_all[step * 16:(step + 1) * 16].to(device), y_all[step * 16:(step + 1) * 16].to(device)
    with torch.autocast(device_type=device, dtype=torch.float16, enabled=args.amp):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
