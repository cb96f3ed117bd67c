"""Fixed variant of ffn_overflow_fp16.py: the bf16 pre-trained model is fine-tuned in bf16, its own format.

Models pre-trained in bf16 (T5 is the famous case) let their feed-forward activations grow far
beyond fp16's largest value, 65504, because bf16 never overflowed there.  Run in fp16, the FFN
output projection overflows to inf, every loss is NaN and the GradScaler skips every step.
"""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
D, T, CLASSES = 32, 16, 4


class FeedForward(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc_in = nn.Linear(d, 4 * d)
        self.fc_out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.mix = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.ffn = FeedForward(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class Encoder(nn.Module):
    def __init__(self, vocab: int = 100, d: int = D, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))


def load_pretrained(model: Encoder) -> None:
    """Stand-in for a bf16 pre-trained checkpoint: the later FFNs carry large weights."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for i, block in enumerate(model.blocks):
            block.ffn.fc_in.weight.normal_(0.0, 2.0 + 6.0 * i, generator=gen)
            block.ffn.fc_out.weight.normal_(0.0, 2.0 + 58.0 * i, generator=gen)


torch.manual_seed(0)
model = Encoder().to(device)
load_pretrained(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

tokens = torch.randint(0, 100, (160, T))
labels = tokens[:, 0] % CLASSES
for step in range(20):
    xb, yb = tokens[step * 8:(step + 1) * 8].to(device), labels[step * 8:(step + 1) * 8].to(device)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        loss = F.cross_entropy(model(xb), yb)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
