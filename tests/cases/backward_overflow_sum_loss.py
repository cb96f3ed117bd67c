"""House-price regression on raw prices (around 3e5) with a summed MSE, fp16 autocast + GradScaler.

The loss gradient with respect to each prediction is 2 * (pred - price), about 6e5: larger than
fp16's 65504 even at loss scale 1.  Every backward overflows where that gradient enters the
fp16 output of the last layer, the GradScaler skips every step and its scale collapses.
"""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
features = torch.randn(512, 8)
prices = 3e5 + 5e4 * features[:, :1] + 1e4 * torch.randn(512, 1)

model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
scaler = torch.amp.GradScaler(device)
for step in range(24):
    x, y = features[step * 16:(step + 1) * 16].to(device), prices[step * 16:(step + 1) * 16].to(device)
    with torch.autocast(device_type=device, dtype=torch.float16):
        pred = model(x)
        loss = F.mse_loss(pred, y, reduction="sum")
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4g} scale {scaler.get_scale():g}")
