"""Fixed variant of scaler_with_bf16.py: bf16 without a GradScaler."""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
images, labels = torch.randn(64, 1, 12, 12), torch.randint(0, 4, (64,))
model = nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 10 * 10, 4)).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(6):
    x, y = images[step * 8:(step + 1) * 8].to(device), labels[step * 8:(step + 1) * 8].to(device)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
