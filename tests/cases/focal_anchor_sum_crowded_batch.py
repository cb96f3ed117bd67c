"""Source: marvis/pytorch-yolo2 issue #91 ("FocalLoss overflow": ``batch_loss.mean()`` raises on
inf) and pytorch/pytorch issue #85791 (a loss that overflows fp16 only when the batch is larger).

A dense detector's classification head scores 4096 anchors per image under fp16 autocast with a
GradScaler. The focal loss is written by hand and normalised the RetinaNet way, by the number of
positive anchors: ``loss_map.sum() / num_pos``. The per-anchor losses are fp16, so the sum is
reduced in fp16. Sparse scenes sum to a few thousand; the third batch is a crowded scene (every
anchor labelled an object, most of them missed by the young head) and its sum passes 65504. The
loss is inf on that batch alone; the next batches are sparse again and clean.
"""
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
head = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
optimizer = torch.optim.SGD(head.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
anchors = torch.randn(6, 4096, 16)
labels = (torch.rand(6, 4096) < 0.02).float()
labels[2] = 1.0  # a crowded scene: every anchor covers an object


def focal_loss(logits, targets, gamma=2.0, weight=8.0):
    p = torch.sigmoid(logits)
    p_t = torch.where(targets > 0, p, 1 - p)
    ce = F.softplus(torch.where(targets > 0, -logits, logits))
    return weight * (1 - p_t) ** gamma * ce


for step in range(6):
    x, t = anchors[step], labels[step]
    with torch.autocast("cpu", dtype=torch.float16):
        logits = head(x).squeeze(-1) - 3.0  # prior: objects are rare
        num_pos = t.sum().clamp(min=1.0)
        loss = focal_loss(logits, t).sum() / num_pos
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():g}")
