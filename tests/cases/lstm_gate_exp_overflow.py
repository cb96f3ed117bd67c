"""Sequence regressor with a hand-written LSTM cell whose gates are 1 / (1 + exp(-x)), the way
numpy LSTMs (ocropy, neuraltalk) wrote the logistic, trained with fp16 autocast and a GradScaler.

The gate pre-activations come from an fp16 Linear over unnormalised IMU readings and reach -54:
exp(54) is 3e23 in fp32 but inf in fp16 (anything above exp(11.1)).  The forward stays finite,
1 / (1 + inf) = 0, but the backward of exp multiplies a zero gradient by the saved inf: NaN.
The first inf is made by the exp inside `cell`; every step is skipped.
"""
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
B, T, FEAT, H = 16, 8, 8, 32


def logistic(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


class LSTMCell(nn.Module):
    def __init__(self, n_in: int, n_hidden: int) -> None:
        super().__init__()
        self.ih = nn.Linear(n_in, 4 * n_hidden)
        self.hh = nn.Linear(n_hidden, 4 * n_hidden)

    def forward(self, x, state):
        h, c = state
        i, f, g, o = (self.ih(x) + self.hh(h)).chunk(4, dim=-1)
        i, f, o = logistic(i), logistic(f), logistic(o)
        c = f * c + i * torch.tanh(g)
        return o * torch.tanh(c), c


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = LSTMCell(FEAT, H)
        self.head = nn.Linear(H, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = c = torch.zeros(x.shape[0], H)
        for t in range(x.shape[1]):
            h, c = self.cell(x[:, t], (h, c))
        return self.head(h).squeeze(-1)


imu = 20.0 * torch.randn(8 * B, T, FEAT)           # raw readings, not standardised
target = imu[:, :, 0].mean(dim=1) / 20.0

model = Regressor()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(8):
    x, y = imu[step * B:(step + 1) * B], target[step * B:(step + 1) * B]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():.0f}")
