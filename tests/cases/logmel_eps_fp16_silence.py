"""Keyword spotter with its log-mel front-end inside the model (fp16 autocast + GradScaler); the user
guards log(0) of the zero-padded, silent clip tails with ``torch.log(mel + 1e-10)``.  Under autocast
``mel`` is fp16 and 1e-10 (below fp16's smallest subnormal, 6e-8) rounds away: 0 + 1e-10 = 0, and
the log in ``frontend`` makes the first bad value, -inf; the encoder turns it into NaN, every step is skipped.
"""
import math

import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
N_FFT, HOP, N_MELS = 64, 32, 16


class LogMel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        n = torch.arange(N_FFT, dtype=torch.float32)
        k = torch.arange(N_FFT // 2 + 1, dtype=torch.float32)
        angle = 2 * math.pi * n[:, None] * k[None, :] / N_FFT
        window = torch.hann_window(N_FFT)[:, None]
        self.register_buffer("cos", window * torch.cos(angle))
        self.register_buffer("sin", window * torch.sin(angle))
        self.register_buffer("melfb", torch.rand(N_FFT // 2 + 1, N_MELS) / 4)

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        frames = wave.unfold(-1, N_FFT, HOP)                     # (batch, frames, N_FFT)
        power = (frames @ self.cos) ** 2 + (frames @ self.sin) ** 2
        mel = power @ self.melfb
        return torch.log(mel + 1e-10)                            # fp16: 0 + 1e-10 = 0 -> -inf


class KeywordSpotter(nn.Module):
    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.frontend = LogMel()
        self.encoder = nn.Sequential(nn.Linear(N_MELS, 32), nn.GELU(), nn.Linear(32, 32))
        self.head = nn.Linear(32, classes)

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.frontend(wave)).mean(dim=1))


waves = 0.3 * torch.randn(64, 1024)
lengths = torch.randint(400, 1024, (64,))
waves[torch.arange(1024)[None, :] >= lengths[:, None]] = 0.0   # clips zero-padded to 1024 samples
labels = torch.randint(0, 4, (64,))

model = KeywordSpotter()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
for step in range(8):
    x, y = waves[step * 8:(step + 1) * 8], labels[step * 8:(step + 1) * 8]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():g}")
