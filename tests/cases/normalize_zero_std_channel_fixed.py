"""The pipeline of ``normalize_zero_std_channel.py`` with a floor on the standard deviation, in
fp32: a constant channel standardises to 0 instead of NaN."""
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
signals, targets = torch.randn(64, 8), torch.randn(64, 1)
signals[:, 3] = 5.0  # a dead channel


def standardise(batch: torch.Tensor) -> torch.Tensor:
    return (batch - batch.mean(0)) / batch.std(0).clamp(min=1e-6)


for step in range(4):
    x, y = standardise(signals[step * 16:(step + 1) * 16]), targets[step * 16:(step + 1) * 16]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.mse_loss(model(x).float(), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
