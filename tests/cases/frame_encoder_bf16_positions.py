"""Source: huggingface/transformers pull request #29285 ("RoPE loses precision" when the position
encodings are computed in bf16) and InternLM/InternLM issue #237 (position embeddings turned to
bf16 with the model).

A speech frame tagger over 1500-frame utterances trained under bf16 autocast. The encoder adds
sinusoidal position encodings built in its own forward from ``torch.arange(T).to(x.dtype)``, the
dtype of its front-end projection's output: bf16. Above 256 the positions round to steps of 2 to 8
frames, and the sines of the fast frequencies are noise: neighbouring frames get the same or
unrelated encodings. The front-end's output is fine; the encoder's own arithmetic on it is not.
"""
import math

import torch
from torch import nn
from torch.nn import functional as F


class FrameEncoder(nn.Module):
    def __init__(self, feats=20, dim=32):
        super().__init__()
        self.frontend = nn.Linear(feats, dim)
        self.mix = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))
        self.register_buffer("freq", torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2) / dim))

    def forward(self, frames):
        x = self.frontend(frames)
        pos = torch.arange(frames.shape[1]).to(x.dtype)
        phase = pos[:, None] * self.freq.to(x.dtype)
        x = x + torch.cat([phase.sin(), phase.cos()], dim=-1)
        return self.mix(x)


class Tagger(nn.Module):
    def __init__(self, classes=8, dim=32):
        super().__init__()
        self.encoder = FrameEncoder(dim=dim)
        self.classify = nn.Linear(dim, classes)

    def forward(self, frames):
        return self.classify(self.encoder(frames))


torch.manual_seed(0)
model = Tagger()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
features = torch.randn(8, 1500, 20) * 0.3
tags = torch.randint(0, 8, (8, 1500))

for step in range(6):
    x, y = features[step % 4 * 2:(step % 4 + 1) * 2], tags[step % 4 * 2:(step % 4 + 1) * 2]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
