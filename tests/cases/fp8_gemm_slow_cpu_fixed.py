"""Fixed variant of fp8_gemm_slow_cpu.py: on this CPU the model trains in bf16, its fastest format; fp8
is for GPUs of compute capability 8.9 or later."""
import torch
from torch import nn
from torch.nn import functional as F

import ampkit

torch.manual_seed(0)
x_all, y_all = torch.randn(128, 32), torch.randn(128, 16)
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
mp = ampkit.MixedPrecision("bf16", device="cpu")  # the fast format of this CPU
model = mp.prepare(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for i in range(2):
    with mp.autocast():
        pred = model(x_all[i * 64:(i + 1) * 64])
    loss = F.mse_loss(pred.float(), y_all[i * 64:(i + 1) * 64])
    mp.backward(loss)
    mp.step(optimizer)
print(f"loss {loss.item():.4f}")
