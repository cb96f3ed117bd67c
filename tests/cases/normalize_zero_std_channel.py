"""Per-channel standardisation in the data pipeline, computed from the batch in fp16: a channel that
is constant in every sample (a dead sensor) has standard deviation 0, and ``(x - mean) / std``
fills it with NaN (0 / 0).  The model then gets NaN inputs: bad data, not a precision problem of
the model.
"""
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
signals, targets = torch.randn(64, 8), torch.randn(64, 1)
signals[:, 3] = 5.0  # a dead channel


def standardise(batch: torch.Tensor) -> torch.Tensor:
    batch = batch.half()
    return ((batch - batch.mean(0)) / batch.std(0)).float()


for step in range(4):
    x, y = standardise(signals[step * 16:(step + 1) * 16]), targets[step * 16:(step + 1) * 16]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.mse_loss(model(x).float(), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
