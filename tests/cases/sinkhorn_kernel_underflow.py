"""An optimal-transport clustering loss: Sinkhorn iterations on the Gibbs kernel ``exp(-C / 0.02)`` of
the cosine cost between embeddings and prototypes, inside the fp16 autocast region. Costs of 0.6-1.3
give kernel entries below exp(-30) ~ 1e-13, all 0 in fp16, so the marginal ``K @ v`` is 0. The first
bad value is made outside any module, by the division ``a / (K @ v)`` (inf); ``K.T @ u`` then makes NaN.
"""
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)


class Clusterer(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32))
        self.prototypes = nn.Linear(32, 8, bias=False)

    def forward(self, x):
        z = F.normalize(self.encoder(x), dim=-1)
        return 1 - z @ F.normalize(self.prototypes.weight, dim=-1).T  # cosine cost, (batch, prototypes)


def sinkhorn_loss(cost, eps=0.02, iters=3):
    n, k = cost.shape
    kernel = torch.exp(-cost / eps)
    a, b = torch.full((n,), 1.0 / n), torch.full((k,), 1.0 / k)
    v = torch.ones(k)
    for _ in range(iters):
        u = a / (kernel @ v)
        v = b / (kernel.T @ u)
    plan = u[:, None] * kernel * v[None, :]
    return (plan * cost).sum()


model = Clusterer()
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
features = torch.randn(64, 16)
for step in range(6):
    x = features[step * 8:(step + 1) * 8]
    with torch.autocast("cpu", dtype=torch.float16):
        cost = model(x)
        loss = sinkhorn_loss(cost)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():g}")
