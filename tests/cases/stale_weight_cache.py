"""Character-level classifier whose whole epoch runs inside one ``torch.autocast`` block (bf16).

Autocast casts each fp32 weight to bf16 once per autocast region and caches the copy.  Because
the optimizer steps inside the same region, every later forward uses the cached copies of the
weights from the first step: the model trains on stale weights until the region closes.
"""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
chars, labels = torch.randint(0, 30, (96, 12)), torch.randint(0, 3, (96,))
model = nn.Sequential(nn.Embedding(30, 16), nn.Flatten(), nn.Linear(16 * 12, 32), nn.ReLU(),
                      nn.Linear(32, 3)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)

with torch.autocast(device_type=device, dtype=torch.bfloat16):
    for step in range(6):
        x, y = chars[step * 16:(step + 1) * 16].to(device), labels[step * 16:(step + 1) * 16].to(device)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
