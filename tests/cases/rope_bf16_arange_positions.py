"""Source: EleutherAI/gpt-neox issue #1003 (rotary embedding computed in the model's reduced precision:
for some (position, feature) pairs the angle is far from its fp32 value).

A small causal language model over 512-token windows trained under bf16 autocast. Its attention
module rotates queries and keys itself: the positions are ``torch.arange(T, dtype=q.dtype)``, in the
dtype of its ``qkv`` projection's output, bf16. bf16 holds integers exactly only up to 256; above it
positions round to steps of 2, and the angles ``pos * inv_freq`` of the fast frequencies (hundreds
of radians, stored with a spacing of 2 to 4 rad) are noise. The projection's own output is within
bf16's rounding of fp32; the damage is done by the attention module's own arithmetic on it.
"""
import torch
from torch import nn
from torch.nn import functional as F


def rotate(x, angles):
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class RotaryAttention(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        with torch.no_grad():  # queries and keys start large: the attention is as sharp as a trained one's
            self.qkv.weight[:2 * dim] *= 4.0
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        pos = torch.arange(x.shape[1], dtype=q.dtype)
        angles = pos[:, None] * self.inv_freq.to(q.dtype)
        q, k = rotate(q, angles), rotate(k, angles)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class TinyLM(nn.Module):
    def __init__(self, vocab=64, dim=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attn = RotaryAttention(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(self.attn(self.embed(tokens)))


torch.manual_seed(0)
model = TinyLM()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
corpus = torch.randint(0, 64, (8, 513))

for step in range(6):
    batch = corpus[step % 4 * 2:(step % 4 + 1) * 2]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
