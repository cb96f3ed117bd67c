"""A gradient penalty under fp16 autocast with a GradScaler: the penalty's gradients come from
``torch.autograd.grad`` of the *scaled* loss, so they carry the loss scale (2**16), and they are
used as they are.

The penalty is scale times too large (its square root of a sum of squares), so it swamps the task
loss, and it changes with every back-off of the scale; the fp16 squares of the scaled gradients
overflow too.  torch's recipe divides the gradients by the scale before forming the penalty.
"""
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
    with torch.autocast("cpu", dtype=torch.float16):
        penalty = torch.stack([g.pow(2).sum() for g in scaled_grads]).sum().sqrt()  # scaled gradients
        loss = loss + 0.1 * penalty
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
