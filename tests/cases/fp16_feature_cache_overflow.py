"""Solar-power nowcasting: to halve memory the dataset caches raw weather fields as float16 and
standardises each batch (in fp32) when it is drawn; fp16 autocast + GradScaler.  Surface pressure in
pascals (~101325) exceeds fp16's 65504, so the cache holds inf there (first bad value, made when the
cache is built) and (inf - mean) / std stays inf: every batch enters the model non-finite, every step is skipped.
"""
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
n = 128
pressure_pa = 101325.0 + 800.0 * torch.randn(n)
temperature_k = 285.0 + 8.0 * torch.randn(n)
cloud_cover = torch.rand(n)
irradiance_wm2 = 600.0 * torch.rand(n)
raw = torch.stack([pressure_pa, temperature_k, cloud_cover, irradiance_wm2], dim=1)
power = (irradiance_wm2 / 600.0 * (1 - 0.7 * cloud_cover) + 0.05 * torch.randn(n))[:, None]
mean, std = raw.mean(0), raw.std(0)
cache = raw.half()                                   # 101325 Pa -> inf


def get_batch(step: int, batch_size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    rows = slice(step * batch_size, (step + 1) * batch_size)
    return (cache[rows].float() - mean) / std, power[rows]


model = nn.Sequential(nn.Linear(4, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
for step in range(8):
    x, y = get_batch(step)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():g}")
