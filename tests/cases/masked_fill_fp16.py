"""Transformer encoder layer with a hand-written padding mask, fine-tuned with fp16 autocast.

The attention masks padded keys with ``scores.masked_fill(mask, -1e9)``.  Under autocast the
scores are fp16, whose largest magnitude is 65504: PyTorch refuses the fill with
"value cannot be converted to type at::Half without overflow".
"""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
PAD = 0


class MaskedSelfAttention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-2, -1) / x.shape[-1] ** 0.5
        scores = scores.masked_fill(pad_mask[:, None, :], -1e9)
        return scores.softmax(dim=-1) @ self.v(x)


class Encoder(nn.Module):
    def __init__(self, vocab: int = 40, d: int = 16, classes: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=PAD)
        self.attn = MaskedSelfAttention(d)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.attn(x, tokens == PAD)
        return self.head(x.mean(dim=1))


torch.manual_seed(0)
tokens = torch.randint(1, 40, (32, 10))
tokens[:, 7:] = PAD
labels = tokens[:, 0] % 2
model = Encoder().to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler(device)
for step in range(4):
    x, y = tokens[step * 8:(step + 1) * 8].to(device), labels[step * 8:(step + 1) * 8].to(device)
    with torch.autocast(device_type=device, dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
