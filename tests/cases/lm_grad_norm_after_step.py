"""Character-level transformer language model (one pre-norm block, causal attention), fp16
autocast + GradScaler, trained by a small trainer class.

The trainer logs the gradient norm through a helper, ``grad_norm()``, which unscales the
gradients first so that the logged norm is the true one.  It is called after
``scaler.step(optimizer)``, for the log line of the finished step, and GradScaler raises
"unscale_() is being called after step()."
"""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
TEXT = "the quick brown fox jumps over the lazy dog " * 8
VOCAB = sorted(set(TEXT))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class CharLM(nn.Module):
    def __init__(self, vocab: int, d: int = 32, context: int = 16) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.block = Block(d, heads=2)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=idx.device).triu(1)
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        return self.head(self.block(x, causal))


class LMTrainer:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        self.scaler = torch.amp.GradScaler(device)

    def grad_norm(self) -> float:
        self.scaler.unscale_(self.optimizer)
        return float(nn.utils.clip_grad_norm_(self.model.parameters(), float("inf")))

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        with torch.autocast(device_type=device, dtype=torch.float16):
            logits = self.model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        norm = self.grad_norm()
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item(), norm


data = torch.tensor([VOCAB.index(c) for c in TEXT])
trainer = LMTrainer(CharLM(len(VOCAB)).to(device))
for step in range(4):
    starts = torch.randint(0, len(data) - 17, (8,))
    x = torch.stack([data[s:s + 16] for s in starts]).to(device)
    y = torch.stack([data[s + 1:s + 17] for s in starts]).to(device)
    loss, norm = trainer.train_step(x, y)
print(f"loss {loss:.3f} grad norm {norm:.3f}")
