"""A hand-written focal loss under fp16 autocast: ``p = sigmoid(logits)`` runs in fp16, where a
confident negative logit (below about -17) rounds p to exactly 0, and ``log(p)`` of a positive label
is then -inf: the loss is inf although the classifier's outputs are finite.

The first bad value is made outside any module, by the log in the loss.
"""
import torch
from torch import nn

torch.manual_seed(0)
classifier = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
with torch.no_grad():
    classifier[2].bias.fill_(-30.0)  # a detector initialised for a rare positive class
optimizer = torch.optim.SGD(classifier.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
features, labels = torch.randn(48, 16), (torch.rand(48, 1) < 0.5).float()
for step in range(6):
    x, y = features[step * 8:(step + 1) * 8], labels[step * 8:(step + 1) * 8]
    with torch.autocast("cpu", dtype=torch.float16):
        p = torch.sigmoid(classifier(x))
        loss = -(y * (1 - p) ** 2 * torch.log(p) + (1 - y) * p ** 2 * torch.log(1 - p)).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
