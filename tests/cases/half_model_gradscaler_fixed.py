"""Fixed variant of half_model_gradscaler.py: fp32 parameters, fp16 autocast, GradScaler."""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
embeddings, labels = torch.randn(64, 24), torch.randint(0, 2, (64,))
model = nn.Sequential(nn.Linear(24, 32), nn.ReLU(), nn.Linear(32, 2)).to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler(device)
for step in range(4):
    x, y = embeddings[step * 16:(step + 1) * 16].to(device), labels[step * 16:(step + 1) * 16].to(device)
    with torch.autocast(device_type=device, dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
