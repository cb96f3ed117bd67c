"""Sound-event classifier on raw waveforms with a learnable filterbank front-end (Conv1d, frame energy,
log1p), fp16 autocast + GradScaler.  Fixed: the loader scales the decoded 16-bit PCM to [-1, 1)
(divides by 32768); the filterbank outputs are then ~0.1 and their energies stay well inside fp16.
"""
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)


class Filterbank(nn.Module):
    def __init__(self, filters: int = 16) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, filters, kernel_size=64, stride=32)

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        out = self.conv(wave[:, None, :])       # (batch, filters, frames)
        energy = out ** 2                        # |out| ~ 0.1: fine in fp16
        return torch.log1p(energy)


class EventClassifier(nn.Module):
    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.filterbank = Filterbank()
        self.head = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, classes))

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        return self.head(self.filterbank(wave).mean(dim=-1))


pcm = (3000 * torch.randn(64, 1024)).clamp(-32768, 32767).to(torch.int16)   # decoded 16-bit PCM
labels = torch.randint(0, 5, (64,))
waves = pcm.float() / 32768.0                                                # scaled to [-1, 1)

model = EventClassifier()
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
