"""Fixed variant of additive_mask_sum.py: the masks are combined as booleans and filled with finfo.min once."""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
PAD, VOCAB, D, T = 0, 50, 32, 12


class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5 + bias
        return self.proj(scores.softmax(dim=-1) @ v)


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.attn = Attention(D)
        self.norm = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB)

    def attention_bias(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        t = tokens.shape[1]
        neg = torch.finfo(dtype).min
        keep = tokens != PAD
        causal = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()
        allowed = causal & keep[:, None, :] & keep[:, :, None]
        return torch.zeros(allowed.shape, dtype=dtype, device=tokens.device).masked_fill(~allowed, neg)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.attn(x, self.attention_bias(tokens, x.dtype))
        return self.lm_head(self.norm(x))


def left_padded_batch(gen: torch.Generator, n: int = 8) -> torch.Tensor:
    rows = []
    for _ in range(n):
        length = int(torch.randint(4, T + 1, (1,), generator=gen))
        seq = torch.randint(1, VOCAB, (length,), generator=gen)
        rows.append(torch.cat([torch.full((T - length,), PAD), seq]))
    return torch.stack(rows)


torch.manual_seed(0)
gen = torch.Generator().manual_seed(0)
model = TinyLM().to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler(device)
for step in range(6):
    tokens = left_padded_batch(gen).to(device)
    targets = tokens[:, 1:].masked_fill(tokens[:, 1:] == PAD, -100)
    with torch.autocast(device_type=device, dtype=torch.float16):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():g}")
