"""Vision model with fp16 + GradScaler and a grad-norm logging helper that unscales.

The helper calls scaler.unscale_(optimizer) to log the true gradient norm; the training loop
then calls scaler.unscale_(optimizer) again before clipping.  GradScaler raises
"unscale_() has already been called on this optimizer since the last update()".
"""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)


def log_grad_norm(model: nn.Module, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> float:
    scaler.unscale_(optimizer)
    norms = [p.grad.norm() for p in model.parameters() if p.grad is not None]
    return float(torch.stack(norms).norm())


images, labels = torch.randn(48, 3, 6, 6), torch.randint(0, 3, (48,))
model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
scaler = torch.amp.GradScaler(device)
for step in range(4):
    x, y = images[step * 12:(step + 1) * 12].to(device), labels[step * 12:(step + 1) * 12].to(device)
    with torch.autocast(device_type=device, dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    grad_norm = log_grad_norm(model, scaler, optimizer)
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} grad norm {grad_norm:.3f}")
