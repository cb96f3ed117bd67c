"""Small CNN with BatchNorm on 16-bit sensor images, fp16 autocast + GradScaler.

One batch contains a saturated frame (raw 16-bit counts up to 65535 instead of [0, 1]).  In
fp16 the first convolution overflows on it; the GradScaler skips that step, but the forward
already folded inf into BatchNorm's running statistics, and skipping does not undo that: every
evaluation afterwards returns NaN.
"""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)


class SensorNet(nn.Module):
    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


frames = torch.rand(64, 1, 8, 8)
labels = (frames.mean(dim=(1, 2, 3)) * 3).long().clamp(max=2)
frames[37] = 65535.0  # a saturated frame, raw counts


model = SensorNet().to(device)
with torch.no_grad():
    model.conv1.weight.mul_(4.0)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
scaler = torch.amp.GradScaler(device)
for step in range(6):
    x, y = frames[step * 8:(step + 1) * 8].to(device), labels[step * 8:(step + 1) * 8].to(device)
    with torch.autocast(device_type=device, dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)

model.eval()
with torch.no_grad(), torch.autocast(device_type=device, dtype=torch.float16):
    accuracy = (model(frames[:16].to(device)).argmax(1) == labels[:16].to(device)).float().mean()
print(f"eval accuracy {accuracy.item():.2f}")
