"""Source: yhenon/pytorch-retinanet issue #3 (the focal loss clamps the classification to
``[1e-4, 1.0 - 1e-4]`` so that its logs stay finite) and zylo117/Yet-Another-EfficientDet-Pytorch
issue #717 (the same BCE can give NaN).

A one-stage detector's classification head, warm-started in fp32 and fine-tuned under bf16 autocast: ``p`` is clamped to
``[1e-4, 1 - 1e-4]`` and the binary cross-entropy is chosen per anchor with ``torch.where(t == 1,
-log(p), -log(1 - p))``. In bf16 the upper bound 1 - 1e-4 rounds to exactly 1.0, so a confident
positive anchor keeps p = 1.0 and the branch that ``where`` discards, log(1 - p), is -inf. The
forward is finite; the backward sends a zero gradient into that -inf's log: 0 * inf = NaN in every
parameter, and the model is NaN after the step.
"""
import torch
from torch import nn

torch.manual_seed(0)
head = nn.Linear(16, 3)
features = torch.randn(6, 256, 16) * 2.0
targets = (features[..., :3] > 1.0).float()
optimizer = torch.optim.SGD(head.parameters(), lr=0.5)
for _ in range(60):  # warm start in fp32: the head is confident on the easy anchors
    warm = nn.functional.binary_cross_entropy_with_logits(head(features[0]), targets[0])
    warm.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
optimizer = torch.optim.SGD(head.parameters(), lr=1e-2)


def focal_loss(logits, t, alpha=0.25, gamma=2.0):
    p = torch.sigmoid(logits).clamp(1e-4, 1.0 - 1e-4)
    alpha_t = torch.where(t == 1, alpha, 1 - alpha)
    focal = torch.where(t == 1, 1 - p, p) ** gamma
    bce = torch.where(t == 1, -torch.log(p), -torch.log(1 - p))
    return (alpha_t * focal * bce).sum() / t.sum().clamp(min=1.0)


for step in range(6):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = focal_loss(head(features[step]), targets[step])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
