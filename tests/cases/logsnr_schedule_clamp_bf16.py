"""Source: koda-dernet/Side-Step pull request #38 (diffusion timesteps clamped to ``[1e-5, 1 - 1e-5]``
because a bf16 sigmoid saturates to exactly 0 or 1; the review notes that 1 - 1e-5 is 1.0 in bf16).

A diffusion model with a learned noise schedule, trained under bf16 autocast: ``alpha =
sigmoid(schedule(t)).clamp(1e-5, 1 - 1e-5)`` and the loss is weighted by the clipped log-SNR,
``(log(alpha) - log1p(-alpha)).clamp(-5, 5)``. Late timesteps drive the schedule's logit past 7, where
the bf16 sigmoid is exactly 1.0 and so is the clamp's bound: log1p(-1) = -inf. The weight is clipped
to 5, so the loss is finite, but the clip's backward sends a zero gradient into log1p's infinite
derivative: 0 * inf = NaN in the schedule's gradients, and the step writes NaN into it.
"""
import torch
from torch import nn
from torch.nn import functional as F


class Schedule(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
        with torch.no_grad():  # monotone in t: noisier with time
            self.net[0].weight.abs_().mul_(2.0)
            self.net[2].weight.fill_(0.8)
            self.net[2].bias.fill_(-4.0)

    def forward(self, t):
        return self.net(t[:, None] * 4.0).squeeze(-1)


torch.manual_seed(0)
schedule = Schedule()
denoiser = nn.Sequential(nn.Linear(9, 64), nn.SiLU(), nn.Linear(64, 8))
params = [*schedule.parameters(), *denoiser.parameters()]
optimizer = torch.optim.Adam(params, lr=1e-3)
data = torch.randn(6, 32, 8)

for step in range(6):
    x0 = data[step]
    t = torch.rand(32)
    noise = torch.randn_like(x0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        alpha = torch.sigmoid(schedule(t)).clamp(1e-5, 1.0 - 1e-5)
        weight = (torch.log(alpha) - torch.log1p(-alpha)).clamp(-5.0, 5.0)
        xt = alpha.sqrt()[:, None] * x0 + (1 - alpha).clamp(min=1e-4).sqrt()[:, None] * noise
        pred = denoiser(torch.cat([xt, t[:, None]], dim=-1))
        loss = (weight.exp()[:, None] * (pred.float() - noise) ** 2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
