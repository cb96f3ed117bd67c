"""Fixed twin of maml_inner_step_scaled_grads.py.

The inner gradients are unscaled before they build the fast weights, as torch's recipe does for
a gradient penalty: g * (1 / scaler.get_scale()), inside the graph, so the meta-gradient is right.
"""
import math

import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

torch.manual_seed(0)
TASKS, SHOTS, ALPHA = 2, 10, 0.01


def sine_task():
    amp, phase = 0.1 + 0.9 * torch.rand(1), math.pi * torch.rand(1)
    x = 10.0 * torch.rand(2 * SHOTS, 1) - 5.0
    y = amp * torch.sin(x + phase)
    return x[:SHOTS], y[:SHOTS], x[SHOTS:], y[SHOTS:]


model = nn.Sequential(nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1))
meta_opt = torch.optim.Adam(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(8):
    meta_loss = 0.0
    for _ in range(TASKS):
        xs, ys, xq, yq = sine_task()
        params = dict(model.named_parameters())
        with torch.autocast("cpu", dtype=torch.float16):
            support_loss = F.mse_loss(model(xs).float(), ys)
        grads = torch.autograd.grad(scaler.scale(support_loss), list(params.values()), create_graph=True)
        inv_scale = 1.0 / scaler.get_scale()
        fast = {name: p - ALPHA * (g * inv_scale) for (name, p), g in zip(params.items(), grads)}
        with torch.autocast("cpu", dtype=torch.float16):
            meta_loss = meta_loss + F.mse_loss(functional_call(model, fast, (xq,)).float(), yq) / TASKS
    scaler.scale(meta_loss).backward()
    scaler.step(meta_opt)
    scaler.update()
    meta_opt.zero_grad(set_to_none=True)
print(f"meta-loss {meta_loss.item():.4f} scale {scaler.get_scale():.0f}")
