"""Thermal-sensor regression whose first layer converts raw readings to Kelvin, trained with
bf16 autocast.

The calibration layer outputs temperatures around 300 K that differ by a few tenths of a
degree from channel to channel.  In bf16 (8 significant bits) the spacing at 300 is 2 K: the
differences the next LayerNorm normalises are mostly rounding noise.  Nothing overflows; the
LayerNorm's output is just far from its fp32 value.
"""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
raw = torch.randn(128, 16)
target = raw[:, :4].sum(1, keepdim=True)


class ThermalNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.to_kelvin = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm(self.to_kelvin(x)))


model = ThermalNet().to(device)
with torch.no_grad():  # factory calibration: 0.25 K per count around 20 °C
    model.to_kelvin.weight.copy_(0.25 * torch.eye(16))
    model.to_kelvin.bias.fill_(293.15)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(8):
    x, y = raw[step * 16:(step + 1) * 16].to(device), target[step * 16:(step + 1) * 16].to(device)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        loss = F.mse_loss(model(x).float(), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
