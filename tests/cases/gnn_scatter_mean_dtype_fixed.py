"""Fixed twin of gnn_scatter_mean_dtype.py.

The aggregation buffer is made with msg.new_zeros(...), so it has the messages' dtype (fp16 under
autocast, fp32 without it) and scatter_reduce_ gets equal dtypes.
"""
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
GRAPHS, ATOMS, ELEMENTS, D = 16, 8, 10, 32


class MessagePassing(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.message = nn.Sequential(nn.Linear(2 * d, d), nn.SiLU(), nn.Linear(d, d))
        self.update = nn.Linear(2 * d, d)

    def forward(self, h: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        msg = self.message(torch.cat([h[src], h[dst]], dim=-1))
        agg = msg.new_zeros(h.shape[0], h.shape[1])
        agg.scatter_reduce_(0, dst[:, None].expand_as(msg), msg, reduce="mean", include_self=False)
        return h + self.update(torch.cat([h, agg.to(h.dtype)], dim=-1))


class MPNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(ELEMENTS, D)
        self.layers = nn.ModuleList([MessagePassing(D) for _ in range(2)])
        self.readout = nn.Linear(D, 1)

    def forward(self, atoms, src, dst):
        h = self.embed(atoms)
        for layer in self.layers:
            h = layer(h, src, dst)
        return self.readout(h.view(GRAPHS, ATOMS, D).mean(dim=1)).squeeze(-1)


def random_batch():
    atoms = torch.randint(0, ELEMENTS, (GRAPHS * ATOMS,))
    src, dst = [], []
    for g in range(GRAPHS):                                  # a chain plus random bonds
        base = g * ATOMS
        pairs = [(i, i + 1) for i in range(ATOMS - 1)]
        pairs += [tuple(sorted(torch.randperm(ATOMS)[:2].tolist())) for _ in range(4)]
        for i, j in pairs:
            src += [base + i, base + j]
            dst += [base + j, base + i]
    return atoms, torch.tensor(src), torch.tensor(dst), torch.randn(GRAPHS)


model = MPNN()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(8):
    atoms, src, dst, y = random_batch()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(atoms, src, dst).float(), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():.0f}")
