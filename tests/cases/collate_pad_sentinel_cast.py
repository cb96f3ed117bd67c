"""Sequence classifier whose hand-written collate pads variable-length sequences with -1e9 (to lose
every max over time) before a per-step Linear, under fp16 autocast.  -1e9 is finite in the fp32 batch,
but autocast's fp16 cast of the batch for ``embed`` (first bad value) makes it -inf (beyond 65504);
-inf times weights of both signs sums to NaN, the max over time is NaN, every step is skipped.
"""
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)


def collate(samples: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    steps = max(seq.shape[0] for seq, _ in samples)
    batch = samples[0][0].new_full((len(samples), steps, samples[0][0].shape[1]), -1e9)
    for i, (seq, _) in enumerate(samples):
        batch[i, :seq.shape[0]] = seq
    return batch, torch.tensor([label for _, label in samples])


class SequenceClassifier(nn.Module):
    def __init__(self, features: int = 12, classes: int = 5) -> None:
        super().__init__()
        self.embed = nn.Linear(features, 48)
        self.head = nn.Linear(48, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.embed(x))               # (batch, steps, 48)
        return self.head(h.amax(dim=1))         # max over time


dataset = [(torch.randn(int(n), 12), int(c)) for n, c in zip(torch.randint(5, 20, (64,)), torch.randint(0, 5, (64,)))]
model = SequenceClassifier()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
for step in range(8):
    x, y = collate(dataset[step * 8:(step + 1) * 8])
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():g}")
