"""The student of ``distillation_temperature_overflow.py`` divides its logits by the temperature
in fp32: the sharpened logits stay finite."""
import torch
from torch import nn
from torch.nn import functional as F


class Student(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10))
        self.temperature = 0.01

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).float() / self.temperature  # sharpened logits, in fp32


torch.manual_seed(0)
student = Student()
optimizer = torch.optim.SGD(student.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
inputs, targets = torch.randn(48, 16) * 1000, torch.randint(0, 10, (48,))
for step in range(6):
    x, y = inputs[step * 8:(step + 1) * 8], targets[step * 8:(step + 1) * 8]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(student(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
