"""Fixed variant of accelerate_masked_fill_fp16.py: the fill value is the dtype's own minimum."""
from types import MethodType

import torch
from accelerate.utils import convert_outputs_to_fp32
from torch import nn
from torch.nn import functional as F

PAD = 0


class MaskedSelfAttention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-2, -1) / x.shape[-1] ** 0.5
        scores = scores.masked_fill(pad_mask[:, None, :], torch.finfo(scores.dtype).min)
        return scores.softmax(dim=-1) @ self.v(x)


def prepare_fp16(model: nn.Module) -> nn.Module:
    """What ``Accelerator(mixed_precision="fp16").prepare(model)`` does on a GPU: wrap ``forward`` in
    fp16 autocast and convert its outputs to fp32 (on CPU Accelerate enables neither, so do it here)."""
    model.forward = MethodType(convert_outputs_to_fp32(torch.autocast("cpu", dtype=torch.float16)(
        type(model).forward)), model)
    return model


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
model = prepare_fp16(Encoder())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(4):
    x, y = tokens[step * 8:(step + 1) * 8], labels[step * 8:(step + 1) * 8]
    loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
