"""Fixed variant of attention_logits_overflow.py: q is scaled by 1/sqrt(head_dim) before the product.

The attention computes q @ k^T and only then divides by sqrt(head_dim).  With the large
activations of this (post-norm, shared query/key projection) model, the raw dot products
exceed 65504 in fp16 before the scaling could bring them back into range.
"""
import math

import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"


class SelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qk = nn.Linear(d, d)  # shared query/key projection
        self.v = nn.Linear(d, d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h, dh = self.heads, c // self.heads
        q = self.qk(x).view(b, t, h, dh).transpose(1, 2)
        v = self.v(x).view(b, t, h, dh).transpose(1, 2)
        scores = (q / math.sqrt(dh)) @ q.transpose(-2, -1)
        attn = scores.softmax(dim=-1)
        y = (attn @ v).transpose(1, 2).reshape(b, t, c)
        return self.out(y)


class Classifier(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 2, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.attn = SelfAttention(d, heads)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = self.norm(x + self.attn(x))
        return self.head(x.mean(dim=1))


torch.manual_seed(0)
model = Classifier().to(device)
with torch.no_grad():  # embeddings and projections as they come out of a long pre-training run
    model.embed.weight.mul_(12.0)
    model.attn.qk.weight.mul_(6.0)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
scaler = torch.amp.GradScaler(device)

data = torch.randint(0, 64, (96, 12))
labels = data.sum(1) % 3
for step in range(12):
    xb, yb = data[step * 8:(step + 1) * 8].to(device), labels[step * 8:(step + 1) * 8].to(device)
    with torch.autocast(device_type=device, dtype=torch.float16):
        loss = F.cross_entropy(model(xb), yb)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():g}")
