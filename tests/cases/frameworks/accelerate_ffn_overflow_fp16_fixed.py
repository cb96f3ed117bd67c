"""Fixed variant of accelerate_ffn_overflow_fp16.py: the bf16 pre-trained model is fine-tuned in bf16, its own format (no scaler needed)."""
from types import MethodType

import torch
from accelerate.utils import convert_outputs_to_fp32
from torch import nn
from torch.nn import functional as F

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


def prepare_bf16(model: nn.Module) -> nn.Module:
    """What ``Accelerator(mixed_precision="bf16").prepare(model)`` does on a GPU: wrap ``forward`` in
    bf16 autocast and convert its outputs to fp32."""
    model.forward = MethodType(convert_outputs_to_fp32(torch.autocast("cpu", dtype=torch.bfloat16)(
        type(model).forward)), model)
    return model


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
model = prepare_bf16(Encoder())
load_pretrained(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

tokens = torch.randint(0, 100, (160, T))
labels = tokens[:, 0] % CLASSES
for step in range(20):
    xb, yb = tokens[step * 8:(step + 1) * 8], labels[step * 8:(step + 1) * 8]
    loss = F.cross_entropy(model(xb), yb)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
