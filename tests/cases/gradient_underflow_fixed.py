"""Fixed variant of gradient_underflow.py: the GradScaler starts at its default scale, 65536."""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
mfcc = torch.randn(256, 40)
keyword = (mfcc[:, :5].sum(1) > 0).long()

layers = []
for _ in range(4):
    layers += [nn.Linear(40, 40), nn.Tanh()]
model = nn.Sequential(*layers, nn.Linear(40, 2)).to(device)
with torch.no_grad():
    for m in model:
        if isinstance(m, nn.Linear):
            m.weight.mul_(0.1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler(device)
for step in range(8):
    x, y = mfcc[step * 32:(step + 1) * 32].to(device), keyword[step * 32:(step + 1) * 32].to(device)
    with torch.autocast(device_type=device, dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():g}")
