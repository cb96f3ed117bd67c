"""Fixed variant of fp8_head_offset.py: the head, whose weights ride on a common offset, is kept out of
fp8 (fp8_filter=["head"], as the doctor verified); under bf16 autocast its weights are rounded to
about 1/256 of their size and the class-specific parts survive.  The body trains in fp8."""
import torch
from torch import nn
from torch.nn import functional as F

import ampkit

torch.manual_seed(0)
x_all = torch.randn(256, 32)
y_all = x_all[:, :16].argmax(dim=1)


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64))
        self.norm = nn.LayerNorm(64, bias=False)
        self.head = nn.Linear(64, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(x)))


model = Classifier()
with torch.no_grad():
    model.head.weight.copy_(8.0 + 0.4 * torch.randn(16, 64))  # a common offset plus the class-specific parts
mp = ampkit.MixedPrecision("fp8", device="cpu", fp8_filter=["head"])  # the final projection
model = mp.prepare(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for i in range(4):
    x, y = x_all[i * 64:(i + 1) * 64], y_all[i * 64:(i + 1) * 64]
    with mp.autocast():
        logits = model(x)
    loss = F.cross_entropy(logits.float(), y)
    mp.backward(loss)
    mp.step(optimizer)
print(f"loss {loss.item():.4f}")
