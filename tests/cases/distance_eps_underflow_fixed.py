"""Fixed variant of distance_eps_underflow.py: the squared distances and their epsilon are computed in fp32."""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
ATOMS, SPECIES, D, RBF = 8, 5, 16, 8


class Interaction(nn.Module):
    """Continuous-filter convolution: messages weighted by a learned filter of the distance."""

    def __init__(self) -> None:
        super().__init__()
        self.metric = nn.Linear(3, 3, bias=False)              # a learned metric on the coordinates
        self.filter = nn.Sequential(nn.Linear(RBF, D), nn.Tanh(), nn.Linear(D, D))
        self.update = nn.Linear(D, D)
        self.register_buffer("centers", torch.linspace(0.0, 3.0, RBF))

    def forward(self, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        pos = self.metric(pos)
        diff = pos[:, :, None, :] - pos[:, None, :, :]
        diff = diff.float()                                    # fp32: 1e-8 stays 1e-8
        dist = torch.sqrt((diff * diff).sum(-1) + 1e-8)
        rbf = torch.exp(-4.0 * (dist[..., None] - self.centers) ** 2)
        messages = self.filter(rbf) * h[:, None, :, :]
        return h + self.update(messages.sum(2))


class EnergyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(SPECIES, D)
        self.interaction = Interaction()
        self.readout = nn.Sequential(nn.Linear(D, D), nn.SiLU(), nn.Linear(D, 1))

    def forward(self, species: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        h = self.interaction(self.embed(species), pos)
        return self.readout(h).sum(dim=(1, 2))


torch.manual_seed(0)
species = torch.randint(0, SPECIES, (256, ATOMS))
positions = torch.randn(256, ATOMS, 3) * 1.5
energies = positions.norm(dim=-1).mean(-1) + 0.1 * species.float().mean(-1)

model = EnergyModel().to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler(device)
for step in range(16):
    sl = slice(step * 4, (step + 1) * 4)
    z, pos, target = species[sl].to(device), positions[sl].to(device), energies[sl].to(device)
    with torch.autocast(device_type=device, dtype=torch.float16):
        pred = model(z, pos)
    loss = F.mse_loss(pred.float(), target)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f} scale {scaler.get_scale():g}")
