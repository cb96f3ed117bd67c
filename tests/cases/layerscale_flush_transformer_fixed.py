"""Fixed variant of layerscale_flush_transformer.py: a GradScaler scales the loss, so the branch gradients
(about 1e-9 unscaled) stay representable during the fp16 backward."""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"


class Block(nn.Module):
    def __init__(self, d: int, heads: int, layer_scale: float = 1e-5) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.gamma1 = nn.Parameter(torch.full((d,), layer_scale))
        self.gamma2 = nn.Parameter(torch.full((d,), layer_scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.gamma1 * self.attn(h, h, h, need_weights=False)[0]
        return x + self.gamma2 * self.mlp(self.norm2(x))


class SentimentEncoder(nn.Module):
    def __init__(self, vocab: int = 100, d: int = 16, heads: int = 2, classes: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        # a pretrained block (its gamma has grown to ~1), then a block appended for the new task
        self.blocks = nn.Sequential(Block(d, heads, layer_scale=1.0), Block(d, heads))
        self.head = nn.Linear(d, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)).mean(dim=1))


torch.manual_seed(0)
reviews = torch.randint(0, 100, (48, 12))
sentiment = (reviews < 50).sum(1).gt(6).long()
model = SentimentEncoder().to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
scaler = torch.amp.GradScaler(device)
for step in range(6):
    x, y = reviews[step * 8:(step + 1) * 8].to(device), sentiment[step * 8:(step + 1) * 8].to(device)
    with torch.autocast(device_type=device, dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
