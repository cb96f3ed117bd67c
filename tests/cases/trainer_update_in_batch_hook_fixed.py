"""Fixed variant of trainer_update_in_batch_hook.py: scaler.update() belongs to the optimizer
step at the accumulation boundary, not to the per-batch hook."""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)


class ResBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class TinyResNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block = ResBlock(8)
        self.head = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(F.relu(self.stem(x))).mean(dim=(2, 3)))


class Trainer:
    def __init__(self, model: nn.Module, accum_steps: int = 4) -> None:
        self.model = model
        self.accum_steps = accum_steps
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        self.scaler = torch.amp.GradScaler(device)

    def optimizer_step(self) -> None:
        self.scaler.unscale_(self.optimizer)
        nn.utils.clip_grad_norm_(self.model.parameters(), 2.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)

    def on_batch_end(self) -> None:
        pass

    def fit(self, images: torch.Tensor, labels: torch.Tensor, batch: int = 4) -> float:
        for i in range(len(images) // batch):
            x = images[i * batch:(i + 1) * batch].to(device)
            y = labels[i * batch:(i + 1) * batch].to(device)
            with torch.autocast(device_type=device, dtype=torch.float16):
                loss = F.cross_entropy(self.model(x), y) / self.accum_steps
            self.scaler.scale(loss).backward()
            if (i + 1) % self.accum_steps == 0:
                self.optimizer_step()
            self.on_batch_end()
        return loss.item() * self.accum_steps


images, labels = torch.randn(32, 3, 8, 8), torch.randint(0, 10, (32,))
trainer = Trainer(TinyResNet().to(device))
print(f"loss {trainer.fit(images, labels):.4f}")
