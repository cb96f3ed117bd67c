"""Depth-estimation style regression with a hand-written loss, fp16 autocast + GradScaler.

The loss is written by hand on the fp16 network output, so it is an fp16 scalar.
scaler.scale(loss) multiplies it by 65536 in fp16: anything above 1.0 overflows to inf, the
step is skipped, and the scale has to fall until loss x scale fits.
"""
import torch
from torch import nn

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
images = torch.randn(128, 16)
depth = (4.0 + images[:, :1].abs() * 3.0).half()  # depth maps are stored in fp16 to save memory

model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler(device)
for step in range(8):
    x, y = images[step * 16:(step + 1) * 16].to(device), depth[step * 16:(step + 1) * 16].to(device)
    with torch.autocast(device_type=device, dtype=torch.float16):
        pred = model(x)
        loss = ((pred - y) ** 2).mean() + 0.1 * (pred - y).abs().mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():g}")
