"""Fine-tuning a small encoder, pre-trained in bf16, with Lightning and
``AmpkitPrecision("16-mixed")`` (fp16 autocast with loss scaling, also on CPU).

Its later FFNs' activations grew beyond fp16's 65504 during bf16 pre-training: the FFN output
projection overflows to inf, every loss is NaN and every step is skipped.
"""
import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F

from ampkit.integrations.lightning import AmpkitPrecision

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


class Encoder(pl.LightningModule):
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

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, labels = batch
        return F.cross_entropy(self(tokens), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def load_pretrained(model: Encoder) -> None:
    """Stand-in for a bf16 pre-trained checkpoint: the later FFNs carry large weights."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for i, block in enumerate(model.blocks):
            block.ffn.fc_in.weight.normal_(0.0, 2.0 + 6.0 * i, generator=gen)
            block.ffn.fc_out.weight.normal_(0.0, 2.0 + 58.0 * i, generator=gen)


torch.manual_seed(0)
model = Encoder()
load_pretrained(model)
tokens = torch.randint(0, 100, (160, T))
data = torch.utils.data.TensorDataset(tokens, tokens[:, 0] % CLASSES)
trainer = pl.Trainer(accelerator="cpu", plugins=[AmpkitPrecision("16-mixed")], max_steps=20, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
