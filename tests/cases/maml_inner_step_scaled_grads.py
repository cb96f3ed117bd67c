"""MAML on few-shot sine regression with fp16 autocast and a GradScaler.  The inner step takes
torch.autograd.grad(scaler.scale(support_loss), params, create_graph=True), the way torch's
gradient-penalty recipe starts, and builds the fast weights w - alpha * g from those gradients.

They still carry the loss scale (65536): the fast weights move 65536 times too far, the query
forward on them overflows fp16 (meta-loss inf, then ~1e7 as the scale falls) and every outer
step is skipped while the scale backs off.  The root is the scaled inner gradient that the fast
weights use without dividing by the scale.
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
        fast = {name: p - ALPHA * g for (name, p), g in zip(params.items(), grads)}
        with torch.autocast("cpu", dtype=torch.float16):
            meta_loss = meta_loss + F.mse_loss(functional_call(model, fast, (xq,)).float(), yq) / TASKS
    scaler.scale(meta_loss).backward()
    scaler.step(meta_opt)
    scaler.update()
    meta_opt.zero_grad(set_to_none=True)
print(f"meta-loss {meta_loss.item():.4f} scale {scaler.get_scale():.0f}")
