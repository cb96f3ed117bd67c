"""Linear-attention encoder (elu+1 feature map, non-causal) over raw sensor windows, fp16 autocast
with a GradScaler.

The windows are fed in the sensors' native units (readings around 400), and the attention module
sums phi(k)^T v over the whole window in one fp16 einsum: every entry of that state is a sum of 64
products of a few hundred each, up to ~3e6, far beyond 65504.  The first inf is made by that einsum in
`blocks.0.attn`; the readout then divides inf by inf, the loss is NaN and every step is skipped.
"""
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
B, T, C, D, HEADS, CLASSES = 8, 64, 8, 32, 2, 4


class LinearAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(dim=2)
        q, k = F.elu(q) + 1, F.elu(k) + 1
        kv = torch.einsum("bthd,bthm->bhdm", k, v)                 # summed over the window
        z = 1.0 / (torch.einsum("bthd,bhd->bth", q, k.sum(dim=1)) + 1e-6)
        y = torch.einsum("bthd,bhdm,bth->bthm", q, kv, z)
        return self.out(y.reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = LinearAttention(d, HEADS)
        self.ffn = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.ffn(x)


class SensorEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(C, D)
        self.blocks = nn.ModuleList([Block(D)])
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h.mean(dim=1)))


offsets = 400.0 + 50.0 * torch.randn(1, 1, C)         # each sensor's operating point, raw units
windows = offsets + 20.0 * torch.randn(8 * B, T, C)
labels = torch.randint(0, CLASSES, (8 * B,))

model = SensorEncoder()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(8):
    x, y = windows[step * B:(step + 1) * B], labels[step * B:(step + 1) * B]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():.0f}")
