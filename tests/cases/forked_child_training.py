"""A small learning-rate sweep that forks one child process per extra learning rate (bf16, CPU).

Each child trains its own copy of the model and exits.  The doctor observes only the process it
started: what the children train is not diagnosed, and their findings never reach the report.
"""
import os

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


children = []
for lr in (0.05, 0.2):
    pid = os.fork()
    if pid == 0:  # the child: one run of the sweep, then leave without running the parent's code
        torch.set_num_threads(1)
        print(f"lr {lr}: loss {train(lr):.4f}")
        os._exit(0)
    children.append(pid)
print(f"lr 0.1: loss {train(0.1):.4f}")
for pid in children:
    os.waitpid(pid, 0)
