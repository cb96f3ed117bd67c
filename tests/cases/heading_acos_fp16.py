"""A visual-odometry network predicting the camera heading of each video frame, fp16 autocast + GradScaler.

Besides the heading, the model returns the turn between consecutive frames, ``acos`` of the
cosine of consecutive unit headings, which a smoothness term penalises.  Consecutive frames
barely differ, so their headings are a fraction of a degree apart: the cosine is 1 - 1e-6 in fp32
but rounds to exactly 1.0 in fp16 (its spacing below 1 is 4.9e-4).  The forward stays finite
(acos(1) = 0), but d acos(x)/dx = -1 / sqrt(1 - x^2) is infinite at 1: every backward is
inf/NaN whatever the loss scale, and the GradScaler skips every step.
"""
import math

import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
FRAMES, SIZE = 4, 8


class TurnAngle(nn.Module):
    """The angle between consecutive unit headings, in radians."""

    def forward(self, heading: torch.Tensor) -> torch.Tensor:
        cos = (heading[:, 1:] * heading[:, :-1]).sum(-1).clamp(-1.0, 1.0)
        return torch.acos(cos)


class HeadingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Flatten(), nn.Linear(SIZE * SIZE, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU())
        self.head = nn.Linear(16, 2)
        self.turn = TurnAngle()

    def forward(self, frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t = frames.shape[:2]
        raw = self.head(self.encoder(frames.flatten(0, 1))).view(b, t, 2)
        heading = raw / (raw * raw).sum(-1, keepdim=True).sqrt()
        return heading, self.turn(heading)


def clips(gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slowly panning clips: each frame is the previous one plus sensor noise."""
    scene = torch.rand(n, 1, 1, SIZE, SIZE, generator=gen)
    frames = scene + 0.1 * torch.randn(n, FRAMES, 1, SIZE, SIZE, generator=gen)
    angle = torch.rand(n, 1, generator=gen) * 2 * math.pi + 0.01 * torch.arange(FRAMES)
    return frames, torch.stack([angle.cos(), angle.sin()], dim=-1)


torch.manual_seed(0)
gen = torch.Generator().manual_seed(0)
model = HeadingNet().to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler(device)
for step in range(16):
    frames, target = (t.to(device) for t in clips(gen, 8))
    with torch.autocast(device_type=device, dtype=torch.float16):
        heading, turn = model(frames)
    loss = F.mse_loss(heading.float(), target) + 0.1 * turn.float().mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():g}")
