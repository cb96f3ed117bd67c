"""Fixed variant of eval_attention_maps_fp16.py: the attention-map path masks with the smallest
value of the scores' own dtype, which fits fp16."""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
PAD = 0


class SelfAttention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, pad: torch.Tensor,
                return_attn: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if not return_attn:
            return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=~pad[:, None, :])), None
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(pad[:, None, :], torch.finfo(scores.dtype).min)
        attn = scores.softmax(dim=-1)
        return self.out(attn @ v), attn


class Classifier(nn.Module):
    def __init__(self, vocab: int = 50, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=PAD)
        self.attn = SelfAttention(d)
        self.head = nn.Linear(d, 2)

    def forward(self, tokens: torch.Tensor,
                return_attn: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.embed(tokens)
        h, attn = self.attn(x, tokens == PAD, return_attn)
        return self.head((x + h).mean(dim=1)), attn


def evaluate(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad(), torch.autocast(device_type=device, dtype=torch.float16):
        _, attn = model(tokens.to(device), return_attn=True)
    model.train()
    return attn


tokens = torch.randint(1, 50, (40, 12))
tokens[::2, 8:] = PAD
labels = (tokens[:, 0] > 25).long()
model = Classifier().to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler(device)
for step in range(4):
    x, y = tokens[step * 8:(step + 1) * 8].to(device), labels[step * 8:(step + 1) * 8].to(device)
    with torch.autocast(device_type=device, dtype=torch.float16):
        logits, _ = model(x)
        loss = F.cross_entropy(logits, y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
attn = evaluate(model, tokens[32:])
print(f"loss {loss.item():.4f}; attention of the first sentence {attn[0, 0, :4].tolist()}")
