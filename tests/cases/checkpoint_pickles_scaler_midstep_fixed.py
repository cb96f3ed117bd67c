"""Keyword-spotting classifier (fp16 autocast + GradScaler), fixed: checkpoint after scaler.update().

The checkpoint is written at the end of the iteration, after scaler.update(), and stores
scaler.state_dict() (the scale and growth tracker) instead of pickling the GradScaler object.
"""
import os
import tempfile

import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
spectra, words = torch.randn(160, 40), torch.randint(0, 6, (160,))
model = nn.Sequential(nn.Linear(40, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 6)).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler(device)

with tempfile.TemporaryDirectory() as ckpt_dir:
    for step in range(10):
        x, y = spectra[step * 16:(step + 1) * 16].to(device), words[step * 16:(step + 1) * 16].to(device)
        with torch.autocast(device_type=device, dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if (step + 1) % 4 == 0:              # the weights just changed: checkpoint them
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "step": step + 1}, os.path.join(ckpt_dir, "last.pt"))
        optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():g}")
