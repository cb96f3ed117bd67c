"""Fixed variant of fp8_residual_growth.py: the last block's fc, whose input holds the grown sink, is kept
out of fp8 (fp8_filter=["blocks.2.fc"], as the doctor verified); under bf16 autocast its input keeps the
small channels, and the other layers train in fp8."""
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
mp = ampkit.MixedPrecision("fp8", device="cpu", fp8_filter=["blocks.2.fc"])  # the last block's fc
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
