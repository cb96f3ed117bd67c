"""The gradient penalty of ``gradient_penalty_scaled.py`` done as torch's recipe does it: the
gradients of the scaled loss are multiplied by ``1 / scaler.get_scale()`` before the penalty is
formed from them."""
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
inputs, targets = torch.randn(48, 16), torch.randn(48, 1)
for step in range(6):
    x, y = inputs[step * 8:(step + 1) * 8], targets[step * 8:(step + 1) * 8]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(x).float(), y)
    scaled_grads = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
    inv_scale = 1.0 / scaler.get_scale()
    grads = [g * inv_scale for g in scaled_grads]  # unscaled, as the recipe does
    with torch.autocast("cpu", dtype=torch.float16):
        penalty = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
        loss = loss + 0.1 * penalty
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
