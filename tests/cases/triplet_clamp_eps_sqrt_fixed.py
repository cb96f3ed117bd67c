"""The batch-hard triplet loss of ``triplet_clamp_eps_sqrt.py`` with the squared distances computed in
fp32 (``emb.float()``): the 1e-12 floor holds, so the diagonal's sqrt runs at 1e-12 (finite derivative)
and the clamp passes it no gradient."""
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
embedder = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32))
optimizer = torch.optim.SGD(embedder.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
crops = torch.randn(96, 16)
identities = torch.arange(48).repeat_interleave(2)  # two crops of each person


def batch_hard_triplet(emb, ids, margin=0.3):
    diff = emb[:, None, :] - emb[None, :, :]
    dist = (diff * diff).sum(dim=-1).clamp(min=1e-12).sqrt()
    same = ids[:, None] == ids[None, :]
    hardest_pos = dist.masked_fill(~same, 0.0).max(dim=1).values
    hardest_neg = dist.masked_fill(same, float("inf")).min(dim=1).values
    return F.margin_ranking_loss(hardest_neg, hardest_pos, torch.ones_like(hardest_pos), margin=margin)


for step in range(6):
    x, ids = crops[step * 16:(step + 1) * 16], identities[step * 16:(step + 1) * 16]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = batch_hard_triplet(embedder(x).float(), ids)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():g}")
