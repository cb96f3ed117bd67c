"""Fixed variant of checkpoint_without_scaler.py: the checkpoint includes scaler.state_dict()."""
import os
import tempfile

import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
images, labels = torch.randn(96, 3, 8, 8), torch.randint(0, 5, (96,))

model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                      nn.Linear(8, 5)).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler(device)

with tempfile.TemporaryDirectory() as ckpt_dir:
    for step in range(8):
        x, y = images[step * 12:(step + 1) * 12].to(device), labels[step * 12:(step + 1) * 12].to(device)
        with torch.autocast(device_type=device, dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % 4 == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "step": step + 1},
                       os.path.join(ckpt_dir, "last.pt"))
print(f"loss {loss.item():.4f}")
