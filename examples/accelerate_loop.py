"""A hand-written Accelerate loop watched by ampkit: fp16 autocast with a GradScaler, fused AdamW.

    pip install 'ampkit[hf]'
    python examples/accelerate_loop.py

Step 5 gets an injected fp16 overflow: the GradScaler skips it and backs the scale off, and ampkit
records the skip although Accelerate's step_was_skipped stays False with a fused optimizer.
"""

from __future__ import annotations

import math

import torch
from accelerate import Accelerator
from torch import nn

from ampkit.integrations.accelerate import watch
from ampkit.telemetry import Telemetry


def main() -> None:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # On a GPU Accelerate makes the GradScaler itself (mixed_precision="fp16"); on CPU it makes none,
    # so this example gives it torch's CPU GradScaler and enters fp16 autocast itself.
    accelerator = Accelerator(cpu=device == "cpu", mixed_precision="fp16" if device == "cuda" else "no")
    if accelerator.scaler is None:
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    records: list[dict] = []
    with watch(accelerator, model, optimizer, scheduler=scheduler, precision="fp16",
               telemetry=Telemetry(sinks=[records.append], flush_every=5)) as watcher:
        for step in range(1, 13):
            x = torch.randn(16, 32, device=accelerator.device)
            y = x[:, :1] * 2.0
            with torch.autocast(accelerator.device.type, dtype=torch.float16):
                loss = (model(x).float() - y).pow(2).mean()
            watcher.record_loss(loss)  # the model returns no loss of its own
            accelerator.backward(loss)
            if step == 5:
                model[0].weight.grad[0, 0] = math.inf  # an fp16 overflow
            optimizer.step()
            if not optimizer.step_was_skipped:  # stays False on fused skips (accelerate#4242)
                scheduler.step()
            optimizer.zero_grad()
            if watcher.should_stop:
                break
    for r in records:
        print(f"step {r['step']:2d}  loss {r['loss']:.4f}  scale {r['scale']:g} -> {r['next_scale']:g}  "
              f"skipped {r['skipped']}")
    for f in watcher.findings:
        print(f"{f.severity}: {f.code}: {f.message}")


if __name__ == "__main__":
    main()
