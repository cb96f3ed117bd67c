"""A two-layer graph attention network (dense GAT) classifying the nodes of a citation-style graph,
fp16 autocast + GradScaler.

Each layer masks non-edges with ``float("-inf")`` and computes a numerically "stable" softmax by
hand: ``e - e.amax(-1)`` first.  The graph has isolated nodes (no edges, and the layer adds no
self-loops): their whole row is -inf, its max is -inf, and -inf - (-inf) = NaN.  Isolated nodes
are not in the training mask, but in the second layer every node's ``alpha @ h`` multiplies their
NaN rows by 0 (still NaN): the loss is NaN, the GradScaler skips every step.
"""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
NODES, FEATURES, HIDDEN, CLASSES = 24, 16, 16, 4


class GATLayer(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d_in, d_out, bias=False)
        self.att_src = nn.Linear(d_out, 1, bias=False)
        self.att_dst = nn.Linear(d_out, 1, bias=False)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        e = F.leaky_relu(self.att_dst(h) + self.att_src(h).transpose(0, 1), 0.2)
        e = e.masked_fill(~adj, float("-inf"))
        e = e - e.amax(dim=-1, keepdim=True)
        alpha = e.exp() / e.exp().sum(dim=-1, keepdim=True)
        return alpha @ h


class GAT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer1 = GATLayer(FEATURES, HIDDEN)
        self.layer2 = GATLayer(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        return self.layer2(F.elu(self.layer1(x, adj)), adj)


torch.manual_seed(0)
features = torch.randn(NODES, FEATURES)
labels = torch.randint(0, CLASSES, (NODES,))
adj = torch.rand(NODES, NODES) < 0.2
adj = adj | adj.T
isolated = torch.arange(NODES) % 8 == 7                     # nodes 7, 15, 23 have no edges
adj[isolated] = False
adj[:, isolated] = False
train_mask = ~isolated

model = GAT().to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
scaler = torch.amp.GradScaler(device)
x, y, a, m = features.to(device), labels.to(device), adj.to(device), train_mask.to(device)
for step in range(6):
    with torch.autocast(device_type=device, dtype=torch.float16):
        logits = model(x, a)
    loss = F.cross_entropy(logits[m].float(), y[m])
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():g}")
