"""Source: tracel-ai/burn issue #4109 (a sum of fp16 values past 65504 is inf) and
marvis/pytorch-yolo2 issue #91 (a loss reduction that overflows on some batches only).

A molecular energy regressor trained under fp16 autocast with a GradScaler. The targets are cached
in fp16 to halve the dataset's memory, so the squared error summed over the batch and divided by its atom count, ``((pred - y) ** 2).sum() / n_atoms``, is
reduced in fp16. Ordinary batches sum to a few dozen; the fourth batch holds a few high-energy
conformers (errors of ~60) and its sum exceeds 65504: the loss is inf on that batch only, the scaler
skips the step, and the next batch is clean. The first bad value is the sum's inf, made between
the model's output and the loss.
"""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(12, 64), nn.SiLU(), nn.Linear(64, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
scaler = torch.amp.GradScaler("cpu")
features = torch.randn(192, 12)
energies = torch.randn(192, 1)
energies[96:128:2] += 90.0  # the fourth batch holds 16 strained conformers
energies = energies.half()  # dataset cache kept in fp16
atoms = torch.randint(8, 24, (192,)).float()

for step in range(6):
    x, y = features[step * 32:(step + 1) * 32], energies[step * 32:(step + 1) * 32]
    n_atoms = atoms[step * 32:(step + 1) * 32].sum()
    with torch.autocast("cpu", dtype=torch.float16):
        pred = model(x)
        loss = ((pred - y) ** 2).sum() / n_atoms
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():g}")
