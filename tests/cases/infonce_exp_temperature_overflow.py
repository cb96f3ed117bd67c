"""A hand-written InfoNCE loss (exp of similarities over their row sum, then ``F.nll_loss`` of the
log) inside the fp16 autocast region. The embeddings are L2-normalised, but ``exp(sim / 0.05)`` of a
positive pair (cosine ~1) is exp(20) ~ 5e8, far beyond fp16's 65504 (CPU autocast runs exp in fp16),
and inf / inf in the normalisation is NaN. The first bad value is made outside any module, by the exp.
"""
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
        loss = info_nce(z1, z2)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():g}")
