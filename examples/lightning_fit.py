"""Train a small Lightning model in fp16 with ampkit's precision plugin (CPU or GPU, 20 steps).

    pip install 'ampkit[lightning]'
    python examples/lightning_fit.py

``AmpkitPrecision("16-mixed")`` runs ampkit's engine inside Lightning: fp16 autocast with loss
scaling (also on CPU, where Lightning's own "16-mixed" falls back to bf16), a fused AdamW with
gradient clipping (which Lightning's own fp16 plugin refuses), an LR schedule that does not
advance on a skipped step, and a telemetry record per optimizer step.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ampkit.integrations.lightning import AmpkitPrecision
from ampkit.telemetry import Telemetry

STEPS = 20


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, fused=True)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=STEPS)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(STEPS * 16, 32)
    y = x[:, :4].sum(dim=1, keepdim=True)
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    records: list[dict] = []
    plugin = AmpkitPrecision(
        "16-mixed",
        keep_fp32=[nn.LayerNorm],  # normalisation layers run in fp32
        telemetry=Telemetry([records.append], flush_every=10),
    )
    trainer = pl.Trainer(accelerator="auto", devices=1, max_steps=STEPS, plugins=[plugin], gradient_clip_val=1.0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*num_workers.*")
        trainer.fit(Regressor(), loader)
    print(f"{'step':>4} {'loss':>9} {'scale':>8} {'skipped':>7} {'lr':>9}")
    for r in records:
        print(f"{r['step']:>4} {r['loss']:>9.4f} {r['scale']:>8g} {r['skipped']!s:>7} {r['lr']:>9.2e}")
    print(f"scheduler steps: {trainer.lr_scheduler_configs[0].scheduler.last_epoch} of {len(records)} optimizer steps "
          f"({sum(r['skipped'] for r in records)} skipped)")


if __name__ == "__main__":
    main()
