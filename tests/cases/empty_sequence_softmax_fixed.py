"""Fixed variant of empty_sequence_softmax.py: padded keys get the finite torch.finfo(dtype).min, so an empty line's rows stay finite."""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
PAD, VOCAB, TAGS, D, T = 0, 40, 6, 32, 10


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-2, -1)) / D ** 0.5
        scores = scores.masked_fill(pad[:, None, :], torch.finfo(scores.dtype).min)
        return self.out(scores.softmax(dim=-1) @ v)


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D, padding_idx=PAD)
        self.pos = nn.Parameter(torch.randn(T, D) * 0.02)
        self.attn = SelfAttention()
        self.ffn = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.classify = nn.Linear(D, TAGS)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pad = tokens == PAD
        x = self.embed(tokens) + self.pos
        x = x + self.attn(x, pad)
        x = x + self.ffn(x)
        return self.classify(x)


def batch(gen: torch.Generator, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.randint(3, T + 1, (n,), generator=gen)
    lengths[int(torch.randint(0, n, (1,), generator=gen))] = 0   # an empty line in the corpus
    tokens = torch.randint(1, VOCAB, (n, T), generator=gen)
    tags = tokens % TAGS
    pad = torch.arange(T)[None, :] >= lengths[:, None]
    return tokens.masked_fill(pad, PAD), tags.masked_fill(pad, -100)


torch.manual_seed(0)
gen = torch.Generator().manual_seed(0)
model = Tagger().to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler(device)
for step in range(6):
    tokens, tags = (t.to(device) for t in batch(gen))
    with torch.autocast(device_type=device, dtype=torch.float16):
        logits = model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, TAGS).float(), tags.reshape(-1), ignore_index=-100)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():g}")
