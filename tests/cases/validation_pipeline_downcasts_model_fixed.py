"""Denoiser trained with fp16 autocast + GradScaler, fixed: validation samples with an fp16 copy.

The pipeline is built on copy.deepcopy(model), so pipe.to(torch.float16) casts the copy and the
live model keeps its fp32 parameters (fp32 master weights, fp16 math under autocast).
"""
import copy

import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)


class Denoiser(nn.Module):
    def __init__(self, d: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d + 1, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(),
                                 nn.Linear(hidden, d))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x, t[:, None]], dim=-1))


class SamplingPipeline:
    """Inference wrapper: holds the denoiser it is given and runs a few denoising steps."""

    def __init__(self, denoiser: nn.Module) -> None:
        self.denoiser = denoiser

    def to(self, dtype: torch.dtype) -> "SamplingPipeline":
        self.denoiser.to(dtype=dtype)
        return self

    @torch.no_grad()
    def __call__(self, noise: torch.Tensor, steps: int = 4) -> torch.Tensor:
        x = noise
        for i in reversed(range(steps)):
            t = torch.full((len(x),), (i + 1) / steps, dtype=x.dtype, device=x.device)
            x = x - self.denoiser(x, t) / steps
        return x


def log_validation(model: nn.Module, noise: torch.Tensor) -> float:
    pipe = SamplingPipeline(copy.deepcopy(model)).to(torch.float16)  # fp16 copy for fast sampling
    model.eval()
    samples = pipe(noise.half())
    model.train()
    return samples.float().std().item()


data = torch.randn(160, 16) * 0.5 + 1.0
model = Denoiser().to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler(device)
val_noise = torch.randn(8, 16, device=device)
sample_std = float("nan")
for step in range(10):
    x0 = data[step * 16:(step + 1) * 16].to(device)
    t = torch.rand(len(x0), device=device)
    noise = torch.randn_like(x0)
    xt = (1 - t[:, None]) * x0 + t[:, None] * noise
    with torch.autocast(device_type=device, dtype=torch.float16):
        loss = F.mse_loss(model(xt, t).float(), noise - x0)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if (step + 1) % 3 == 0:
        sample_std = log_validation(model, val_noise)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():g} sample std {sample_std:.3f}")
