"""Fixed variant of rmsnorm_no_upcast.py: the RMSNorm upcasts to fp32 (as LLaMA's reference code does)."""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB, D = 64, 32


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        variance = (x * x).mean(dim=-1, keepdim=True)
        return (x * torch.rsqrt(variance + self.eps)).to(dtype) * self.weight


class MLPBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.pre_norm = RMSNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)
        self.post_norm = RMSNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(F.silu(self.up(self.pre_norm(x))))
        return x + self.post_norm(h)


class TinyLlama(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(MLPBlock(D) for _ in range(layers))
        self.norm = RMSNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


torch.manual_seed(0)
model = TinyLlama().to(device)
with torch.no_grad():  # the pre-trained down projection's massive-activation channel
    for block in model.blocks:
        block.down.weight[3].fill_(40.0)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler(device)
data = torch.randint(0, VOCAB, (64, 9))
for step in range(6):
    batch = data[step * 8:(step + 1) * 8].to(device)
    with torch.autocast(device_type=device, dtype=torch.float16):
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
