"""House-price regression from a CSV-like table; one row has a missing value that parsed as NaN.

fp16 autocast with a GradScaler: the NaN row makes one step's loss NaN, the scaler skips that
step, and nothing in the log says why.
"""
import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--batch-size", type=int, default=32)
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)


def load_table(n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    features = torch.randn(n, 12)
    target = features[:, :3].sum(1, keepdim=True) + 0.1 * torch.randn(n, 1)
    features[41, 7] = float("nan")  # "n/a" in the source file
    return features, target


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


x, y = load_table()
loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=False)
model = Regressor().to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler(device, init_scale=1024.0)

for epoch in range(args.epochs):
    for xb, yb in loader:
        xb, yb = xb.to(device), yb.to(device)
        with torch.autocast(device_type=device, dtype=torch.float16):
            pred = model(xb)
            loss = nn.functional.mse_loss(pred, yb)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
print(f"final loss {loss.item():.4f}")
