"""House-price regression from a CSV-like table, trained by a stock Lightning Trainer with
``precision="bf16-mixed"`` on CPU.  One row has a missing value that parsed as NaN: that step's
loss is NaN and the weights take NaN gradients.
"""
import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F


def load_table(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    features = torch.randn(n, 12, generator=g)
    target = features[:, :3].sum(1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)
    features[21, 7] = float("nan")  # "n/a" in the source file
    return features, target


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


torch.manual_seed(0)
trainer = pl.Trainer(accelerator="cpu", precision="bf16-mixed", max_steps=4, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Regressor(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*load_table()), batch_size=16))
