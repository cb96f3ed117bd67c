"""Sequence classifier: a hand-written collate pads variable-length sequences, the model max-pools
over time after a per-step Linear, under fp16 autocast.  Fixed: the collate pads with 0 and returns
the lengths; the model masks the padded steps *after* ``embed``, with the smallest value of the
activations' own dtype (``torch.finfo(h.dtype).min``), so they still lose every max over time.
"""
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)


def collate(samples: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    steps = max(seq.shape[0] for seq, _ in samples)
    batch = samples[0][0].new_zeros((len(samples), steps, samples[0][0].shape[1]))
    for i, (seq, _) in enumerate(samples):
        batch[i, :seq.shape[0]] = seq
    lengths = torch.tensor([seq.shape[0] for seq, _ in samples])
    return batch, torch.tensor([label for _, label in samples]), lengths


class SequenceClassifier(nn.Module):
    def __init__(self, features: int = 12, classes: int = 5) -> None:
        super().__init__()
        self.embed = nn.Linear(features, 48)
        self.head = nn.Linear(48, classes)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.embed(x))               # (batch, steps, 48)
        pad = torch.arange(x.shape[1])[None, :] >= lengths[:, None]
        h = h.masked_fill(pad[:, :, None], torch.finfo(h.dtype).min)
        return self.head(h.amax(dim=1))         # max over time


dataset = [(torch.randn(int(n), 12), int(c)) for n, c in zip(torch.randint(5, 20, (64,)), torch.randint(0, 5, (64,)))]
model = SequenceClassifier()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
for step in range(8):
    x, y, lengths = collate(dataset[step * 8:(step + 1) * 8])
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x, lengths).float(), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():g}")
