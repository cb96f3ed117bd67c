"""The focal loss of ``focal_loss_sigmoid_underflow.py`` from the logits: log-sigmoids
(``F.logsigmoid``) never round to log(0), and the loss is computed in fp32."""
import torch
from torch import nn
from torch.nn import functional as F

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
        logits = classifier(x).float()
    p = torch.sigmoid(logits)
    loss = -(y * (1 - p) ** 2 * F.logsigmoid(logits) + (1 - y) * p ** 2 * F.logsigmoid(-logits)).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
