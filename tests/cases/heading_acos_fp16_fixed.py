"""Fixed variant of heading_acos_fp16.py: the headings are normalised and the turn angle computed in fp32,
its cosine clamped inside (-1, 1).  Consecutive headings are almost parallel, so 1 - cos is about 5e-5:
headings rounded to fp16 (a relative spacing of 1e-3) would leave the angle, and its gradient, mostly
rounding noise."""
import math

import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
FRAMES, SIZE = 4, 8


class TurnAngle(nn.Module):
    """The angle between consecutive unit headings, in radians."""

    def forward(self, heading: torch.Tensor) -> torch.Tensor:
        with torch.autocast(heading.device.type, enabled=False):
            h = heading.float()
            cos = (h[:, 1:] * h[:, :-1]).sum(-1).clamp(-1.0 + 1e-6, 1.0 - 1e-6)
            return torch.acos(cos)


class HeadingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Flatten(), nn.Linear(SIZE * SIZE, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU())
        self.head = nn.Linear(16, 2)
        self.turn = TurnAngle()

    def forward(self, frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t = frames.shape[:2]
        raw = self.head(self.encoder(frames.flatten(0, 1))).view(b, t, 2).float()
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
