"""Classifier trained in fp8 (ampkit.MixedPrecision("fp8")) whose final projection, the head, is
the layer fp8 hurts most: its weights share a large common offset (8 here; each class row is that
offset plus a class-specific part of about 0.4), and the LayerNorm before it centres its input.

In fp32 the offset contributes nothing (the centred input sums to zero), so each logit is the sum
of the small class-specific parts.  e4m3 keeps 3 mantissa bits: after torchao's tensorwise scaling
each weight near 8 is stored to within about ±0.3, comparable to the class-specific parts, so they
round away and the logits are mostly rounding noise (the head's own output is a few dB from fp32).
No layer after the head can average the error out: the first and last layers are
the ones usually left in high precision (torchtitan #469 keeps the output Linear out of fp8,
torchtitan #4008 fixes its filter to name lm_head; pytorch/torchtune #2404).
"""
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
mp = ampkit.MixedPrecision("fp8", device="cpu")
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
