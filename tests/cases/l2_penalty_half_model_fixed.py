"""The model of ``l2_penalty_half_model.py`` kept in fp32 under bf16 autocast, with the L2
penalty summed in fp32 (weight decay in the optimizer would do the same)."""
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0.0, 1.0)  # a badly scaled initialisation: unit-variance weights
optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
inputs, targets = torch.randn(32, 256), torch.randn(32, 256)
for step in range(4):
    x, y = inputs[step * 8:(step + 1) * 8], targets[step * 8:(step + 1) * 8]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    l2 = sum((p * p).sum() for p in model.parameters())
    loss = F.mse_loss(out.float(), y.float()) + 1e-4 * l2
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
