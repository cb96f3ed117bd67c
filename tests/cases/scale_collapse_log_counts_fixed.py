"""Fixed variant of scale_collapse_log_counts.py: log1p keeps zero counts finite."""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
counts = torch.poisson(torch.full((320, 6), 2.0))  # impressions, clicks, ... per item; zeros happen
clicked = (counts[:, 1] > counts[:, 0] / 2).float()
features = torch.log1p(counts)

model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1)).to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler(device)
for step in range(20):
    x, y = features[step * 16:(step + 1) * 16].to(device), clicked[step * 16:(step + 1) * 16].to(device)
    with torch.autocast(device_type=device, dtype=torch.float16):
        loss = F.binary_cross_entropy_with_logits(model(x).squeeze(-1), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():g}")
