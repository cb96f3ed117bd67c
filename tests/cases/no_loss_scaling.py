"""Speech-command style classifier trained with fp16 autocast but without a GradScaler.

The script enables fp16 autocast "for speed" and calls loss.backward() directly.  Small
gradients (here: of a deep, narrow network with a mean loss) fall below fp16's smallest
subnormal, 6e-8, and become exactly zero: parts of the network stop learning.
"""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
features = torch.randn(256, 40)
labels = (features[:, :5].sum(1) > 0).long()

layers = []
for _ in range(4):
    layers += [nn.Linear(40, 40), nn.Tanh()]
model = nn.Sequential(*layers, nn.Linear(40, 2)).to(device)
with torch.no_grad():
    for m in model:
        if isinstance(m, nn.Linear):
            m.weight.mul_(0.1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(8):
    x, y = features[step * 32:(step + 1) * 32].to(device), labels[step * 32:(step + 1) * 32].to(device)
    with torch.autocast(device_type=device, dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
