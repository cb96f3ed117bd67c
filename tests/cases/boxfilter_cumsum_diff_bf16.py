"""Source: scikit-image/scikit-image pull request #5392 (integral images lose accuracy to the
cumulative sum's rounding, so they are promoted to double) and opencv/opencv pull request #7127
(a box filter's running sum in float).

A 1-D guided-filter smoother for sensor traces, trained under bf16 autocast. The smoother's own
forward computes a moving average the fast way, as differences of a cumulative sum:
``c = x.cumsum(-1); (c[..., w:] - c[..., :-w]) / w``, on its guide convolution's bf16 output. Over
2048 samples of a positive signal the cumulative sum reaches a few thousand, which bf16 stores with
a spacing of 8 to 16; the difference of two such sums over a 16-sample window (about 16) is mostly
rounding error. The convolution's output is fine; the smoother's own arithmetic destroys it.
"""
import torch
from torch import nn
from torch.nn import functional as F


class BoxSmoother(nn.Module):
    def __init__(self, channels=8, window=16):
        super().__init__()
        self.guide = nn.Conv1d(1, channels, kernel_size=5, padding=2)
        self.window = window
        self.mix = nn.Conv1d(channels, 1, kernel_size=1)

    def forward(self, trace):
        g = F.softplus(self.guide(trace))
        c = F.pad(g.cumsum(dim=-1), (1, 0))
        mean = (c[..., self.window:] - c[..., :-self.window]) / self.window
        return self.mix(mean)


class Denoiser(nn.Module):
    def __init__(self):
        super().__init__()
        self.smooth = BoxSmoother()
        self.out = nn.Conv1d(1, 1, kernel_size=3, padding=1)

    def forward(self, trace):
        return self.out(self.smooth(trace))


torch.manual_seed(0)
model = Denoiser()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
clean = torch.sin(torch.linspace(0, 60, 2048)).expand(8, 1, 2048) + 1.5
noisy = clean + 0.3 * torch.randn(8, 1, 2048)

for step in range(6):
    x, y = noisy[step % 4 * 2:(step % 4 + 1) * 2], clean[step % 4 * 2:(step % 4 + 1) * 2]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pred = model(x)
    loss = F.mse_loss(pred.float(), y[..., 15:])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
