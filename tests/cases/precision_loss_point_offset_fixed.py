"""Fixed variant of precision_loss_point_offset.py: each object is centred on its mean point before the
embedding, so the encoder sees decimetres instead of hundreds of metres."""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"


class PointEncoder(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Linear(3, dim)

    def forward(self, xyz: torch.Tensor) -> torch.Tensor:
        return self.embed(xyz - xyz.mean(dim=1, keepdim=True))  # centre each object first, in fp32


class PointNet(nn.Module):
    def __init__(self, dim: int = 32, classes: int = 3) -> None:
        super().__init__()
        self.encoder = PointEncoder(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.head = nn.Linear(dim, classes)

    def forward(self, xyz: torch.Tensor) -> torch.Tensor:
        return self.head(self.mlp(self.encoder(xyz)).amax(dim=1))


def make_objects(n: int, points: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    kind = torch.randint(0, 3, (n,))
    extent = torch.tensor([[0.1, 0.1, 1.5], [1.0, 0.5, 0.4], [0.4, 0.4, 0.4]])[kind]  # pole, car, bush
    local = (torch.rand(n, points, 3) - 0.5) * extent[:, None, :]
    origin = torch.tensor([350.0, 120.0, 40.0]) + torch.randn(n, 1, 3) * 5.0
    return origin + local, kind


torch.manual_seed(0)
clouds, kinds = make_objects(64)
model = PointNet().to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(8):
    xyz, y = clouds[step * 8:(step + 1) * 8].to(device), kinds[step * 8:(step + 1) * 8].to(device)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        loss = F.cross_entropy(model(xyz).float(), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
