"""The InfoNCE loss of ``infonce_exp_temperature_overflow.py`` computed after the autocast region on
fp32 embeddings (``z1.float()``, ``z2.float()``): exp(1 / 0.05) ~ 5e8 fits fp32, and the loss is an
fp32 value."""
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
encoder = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32))
optimizer = torch.optim.SGD(encoder.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
images = torch.randn(48, 16)
temperature = 0.05


def info_nce(z1, z2):
    z1, z2 = F.normalize(z1, dim=-1), F.normalize(z2, dim=-1)
    sim = torch.exp(z1 @ z2.T / temperature)  # positives on the diagonal
    probs = sim / sim.sum(dim=1, keepdim=True)
    return F.nll_loss(torch.log(probs), torch.arange(len(probs)))


for step in range(6):
    x = images[step * 8:(step + 1) * 8]
    view1, view2 = x + 0.05 * torch.randn_like(x), x + 0.05 * torch.randn_like(x)
    with torch.autocast("cpu", dtype=torch.float16):
        z1, z2 = encoder(view1), encoder(view2)
    loss = info_nce(z1.float(), z2.float())
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():g}")
