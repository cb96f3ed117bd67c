"""Preemptible regression job (fp16 autocast + GradScaler) that checkpoints and resumes.

The checkpoint holds the GradScaler state next to the model and the optimizer, but the resume
path restores only the model and the optimizer.  Every resumed job starts again at the initial
scale, 65536, where these gradients overflow: the scale learned before the preemption is lost
and the first step after each resume is skipped.
"""
import os
import tempfile

import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
VOLTS = 6.6
# battery packs: 23 standardised sensor channels and the raw pack voltage (~6.6 V); target: hours left
features = torch.cat([torch.randn(160, 23), VOLTS + 0.2 * torch.randn(160, 1)], dim=1)
targets = 5.0 + features[:, :4].sum(dim=1, keepdim=True) * 0.2 + 0.1 * torch.randn(160, 1)


def run_job(ckpt_path: str, first_step: int, steps: int) -> tuple[float, int, float]:
    """One job of the preemptible run: resume from ckpt_path if it exists, train, checkpoint."""
    model = nn.Sequential(nn.Linear(24, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device)
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, weights_only=True)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
    start_scale, skipped = scaler.get_scale(), 0
    for step in range(first_step, first_step + steps):
        x, y = features[step * 16:(step + 1) * 16].to(device), targets[step * 16:(step + 1) * 16].to(device)
        with torch.autocast(device_type=device, dtype=torch.float16):
            loss = F.l1_loss(model(x).float(), y)
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        skipped += scaler.get_scale() < scale
        optimizer.zero_grad(set_to_none=True)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(), "step": first_step + steps}, ckpt_path)
    return start_scale, skipped, loss.item()


with tempfile.TemporaryDirectory() as ckpt_dir:
    path = os.path.join(ckpt_dir, "last.pt")
    jobs = [run_job(path, first, 3) for first in (0, 3, 6)]  # preempted every 3 steps
print(f"loss {jobs[-1][2]:.4f}; per job: start scales {[j[0] for j in jobs]},"
      f" skipped steps {[j[1] for j in jobs]}")
