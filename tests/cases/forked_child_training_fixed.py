"""The learning-rate sweep of forked_child_training.py, one run after the other in one process: the
doctor observes every run."""
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))


def train(lr: float, steps: int = 4) -> float:
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        xb, yb = x[step * 16:(step + 1) * 16], y[step * 16:(step + 1) * 16]
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss.item()


for lr in (0.1, 0.05, 0.2):
    print(f"lr {lr}: loss {train(lr):.4f}")
