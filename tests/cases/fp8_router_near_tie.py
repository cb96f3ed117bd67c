"""Mixture-of-experts regressor trained in fp8 whose router sees nearly equal logits: each row of the
gate is one shared vector (entries of about ±3) plus a per-expert part of about 0.1, the near-uniform
routing that a load-balancing loss keeps early in training.

The softmax over the experts removes the shared part of the logits, so the routing weights depend
only on the per-expert parts.  After torchao's tensorwise scaling e4m3 stores a gate weight near 3 to
within about ±0.2: the per-expert parts are rounded away and the routing weights, hence the mixture,
are mostly rounding noise, while the gate's own output stays close to fp32 (its logits are dominated
by the shared part).  Router GEMMs are commonly kept in higher precision (torchtitan #2389 runs
moe.gate in fp32; vllm-project/vllm-ascend #9617 keeps the router gate in fp32 because expert
selection is sensitive to the logits' precision).
"""
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
