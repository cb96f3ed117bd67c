"""MNIST-style MLP classifier trained with Lightning and ``AmpkitPrecision("16-mixed")`` (fp16
autocast with loss scaling, also on CPU), with its own gradient clipping.

Fixed: the clipping moved to ``Trainer(gradient_clip_val=1.0)``, which the engine applies to the
unscaled gradients.
"""
import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F

from ampkit.integrations.lightning import AmpkitPrecision


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Flatten(), nn.Linear(196, 64), nn.ReLU(), nn.Linear(64, 10))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


torch.manual_seed(0)
images = torch.rand(256, 1, 14, 14)
labels = (images.mean(dim=(1, 2, 3)) * 10).long().clamp(max=9)
trainer = pl.Trainer(accelerator="cpu", plugins=[AmpkitPrecision("16-mixed")], max_steps=8, logger=False,
                     gradient_clip_val=1.0, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Classifier(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=32))
