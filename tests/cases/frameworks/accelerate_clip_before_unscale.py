"""MNIST-style MLP classifier in an Accelerate-style fp16 loop (forward wrapped in fp16 autocast
as ``Accelerator.prepare`` does, a GradScaler) with gradient clipping.

The gradients are clipped with ``torch.nn.utils.clip_grad_norm_`` right after backward, while
they still hold loss x 65536 (``accelerator.clip_grad_norm_`` would unscale first): every step
is clipped far harder than intended.
"""
from types import MethodType

import torch
from accelerate.utils import convert_outputs_to_fp32
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
images = torch.rand(256, 1, 14, 14)
labels = (images.mean(dim=(1, 2, 3)) * 10).long().clamp(max=9)

def prepare_fp16(model: nn.Module) -> nn.Module:
    """What ``Accelerator(mixed_precision="fp16").prepare(model)`` does on a GPU: wrap ``forward`` in
    fp16 autocast and convert its outputs to fp32 (on CPU Accelerate enables neither, so do it here)."""
    model.forward = MethodType(convert_outputs_to_fp32(torch.autocast("cpu", dtype=torch.float16)(
        type(model).forward)), model)
    return model


model = nn.Sequential(nn.Flatten(), nn.Linear(196, 64), nn.ReLU(), nn.Linear(64, 10))
model = prepare_fp16(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
scaler = torch.amp.GradScaler("cpu")

for step in range(8):
    x, y = images[step * 32:(step + 1) * 32], labels[step * 32:(step + 1) * 32]
    loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
