"""Residual MLP trained in fp8 whose residual stream grows with depth, in two ways: each block's
branch writes three times more than the one before it, and one channel of the stream, a bias-like
"sink" the layers never read (their weights on it stay zero), is amplified 600-fold by every block's
skip path.

Tensorwise scaling gives each fp8 input one scale, set by its largest value.  The first block's
input is fine and the second's peaks at about 900 (a tenth of a percent flushes), but the third
block reads the sink at about 5.5e5 next to other channels of order 1 to 10: after scaling, the
rest of its input falls below e4m3's smallest subnormal and flushes to zero, so the last block,
which writes most of the output, computes from nothing.  Activation norms that grow layer after
layer are the usual behaviour of a residual stack (allenai/OLMo #797); the input of a late fp8 layer
is where that growth costs precision.
"""
import torch
from torch import nn
from torch.nn import functional as F

import ampkit

torch.manual_seed(0)
x_all = torch.randn(256, 32)
y_all = torch.tanh(x_all[:, :10] * 1.5)
SINK = torch.tensor([0])


def ignore_sink(linear: nn.Linear) -> None:
    with torch.no_grad():
        linear.weight[:, 0] = 0.0
    linear.weight.register_hook(lambda g: g.index_fill(1, SINK, 0.0))  # the sink is never read


class Block(nn.Module):
    def __init__(self, depth: int, dim: int = 64) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        with torch.no_grad():
            self.proj.weight.mul_(3.0 ** depth)  # each branch writes three times more
        skip = torch.ones(dim)
        skip[0] = 600.0  # the sink grows 600-fold per block
        self.register_buffer("skip", skip)
        ignore_sink(self.fc)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.skip + self.proj(F.gelu(self.fc(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(32, 64)
        self.blocks = nn.Sequential(*[Block(depth) for depth in range(3)])
        self.head = nn.Linear(64, 10)  # 10 targets: not a multiple of 16, so it stays out of fp8
        ignore_sink(self.head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x).float()))


model = Net()
mp = ampkit.MixedPrecision("fp8", device="cpu")
model = mp.prepare(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for i in range(4):
    x, y = x_all[i * 64:(i + 1) * 64], y_all[i * 64:(i + 1) * 64]
    with mp.autocast():
        pred = model(x)
    loss = F.mse_loss(pred.float(), y)
    mp.backward(loss)
    mp.step(optimizer)
print(f"loss {loss.item():.4f}")
