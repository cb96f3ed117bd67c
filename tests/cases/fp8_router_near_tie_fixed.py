"""Fixed variant of fp8_router_near_tie.py: the router is kept out of fp8 (fp8_filter=["moe.gate"], as
the doctor verified), so its nearly equal logits keep their per-expert parts; the experts train in fp8."""
import torch
from torch import nn
from torch.nn import functional as F

import ampkit

torch.manual_seed(0)
x_all = torch.randn(256, 32)
y_all = torch.tanh(x_all[:, :16] * 1.5)


class MoE(nn.Module):
    def __init__(self, dim: int = 64, experts: int = 16, out: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.Linear(dim, experts * out, bias=False)  # the experts' outputs side by side
        self.shape = (experts, out)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.norm(h)
        weights = F.softmax(self.gate(h).float(), dim=-1)
        outs = self.experts(h).float().view(h.shape[0], *self.shape)
        return torch.einsum("be,beo->bo", weights, outs)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(32, 64), nn.GELU())
        self.moe = MoE()
        self.head = nn.Linear(32, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(self.embed(x)))


model = Net()
with torch.no_grad():
    shared = 3.0 * torch.randn(64)
    model.moe.gate.weight.copy_(shared + 0.1 * torch.randn(16, 64))  # nearly equal rows
mp = ampkit.MixedPrecision("fp8", device="cpu", fp8_filter=["moe.gate"])  # the router
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
