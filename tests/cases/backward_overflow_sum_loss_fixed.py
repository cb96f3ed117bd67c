"""Fixed variant of backward_overflow_sum_loss.py: standardised targets and a mean loss."""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
features = torch.randn(512, 8)
prices = 3e5 + 5e4 * features[:, :1] + 1e4 * torch.randn(512, 1)
price_mean, price_std = prices.mean(), prices.std()
prices = (prices - price_mean) / price_std  # predict standardised prices

model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler(device)
for step in range(24):
    x, y = features[step * 16:(step + 1) * 16].to(device), prices[step * 16:(step + 1) * 16].to(device)
    with torch.autocast(device_type=device, dtype=torch.float16):
        pred = model(x)
        loss = F.mse_loss(pred, y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4g} scale {scaler.get_scale():g}")
