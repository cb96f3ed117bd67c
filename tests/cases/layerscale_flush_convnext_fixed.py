"""Fixed variant of layerscale_flush_convnext.py: a GradScaler scales the loss, so the branch gradients
(about 1e-9 unscaled) sit near 1e-4 during the fp16 backward."""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"


class Block(nn.Module):
    def __init__(self, dim: int, layer_scale: float = 1e-6) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.pwconv1 = nn.Linear(dim, 2 * dim)
        self.pwconv2 = nn.Linear(2 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), layer_scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.pwconv2(F.gelu(self.pwconv1(y)))
        return x + (self.gamma * y).permute(0, 3, 1, 2)


class TinyConvNeXt(nn.Module):
    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 2, stride=2)
        self.stage1 = Block(8, layer_scale=1.0)  # fine-tuned stage: its gamma has grown to ~1
        self.down = nn.Conv2d(8, 16, 2, stride=2)
        self.stage2 = Block(16)  # freshly added stage, ConvNeXt's default init
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stage2(self.down(self.stage1(self.stem(x))))
        return self.head(x.mean(dim=(2, 3)))


torch.manual_seed(0)
images = torch.randn(48, 3, 8, 8)
labels = torch.randint(0, 4, (48,))
model = TinyConvNeXt().to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
scaler = torch.amp.GradScaler(device)
for step in range(6):
    x, y = images[step * 8:(step + 1) * 8].to(device), labels[step * 8:(step + 1) * 8].to(device)
    with torch.autocast(device_type=device, dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
