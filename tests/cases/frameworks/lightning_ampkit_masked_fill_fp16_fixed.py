"""Fixed variant of lightning_ampkit_masked_fill_fp16.py: the fill value is the dtype's own minimum."""
import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F

from ampkit.integrations.lightning import AmpkitPrecision

PAD = 0


class MaskedSelfAttention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-2, -1) / x.shape[-1] ** 0.5
        scores = scores.masked_fill(pad_mask[:, None, :], torch.finfo(scores.dtype).min)
        return scores.softmax(dim=-1) @ self.v(x)


class Encoder(pl.LightningModule):
    def __init__(self, vocab: int = 40, d: int = 16, classes: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=PAD)
        self.attn = MaskedSelfAttention(d)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.attn(x, tokens == PAD)
        return self.head(x.mean(dim=1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, labels = batch
        return F.cross_entropy(self(tokens), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


torch.manual_seed(0)
tokens = torch.randint(1, 40, (32, 10))
tokens[:, 7:] = PAD
data = torch.utils.data.TensorDataset(tokens, tokens[:, 0] % 2)
trainer = pl.Trainer(accelerator="cpu", plugins=[AmpkitPrecision("16-mixed")], max_steps=4, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Encoder(), torch.utils.data.DataLoader(data, batch_size=8))
