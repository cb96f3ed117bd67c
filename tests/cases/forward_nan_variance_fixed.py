"""Fixed variant of forward_nan_variance.py: the variance is computed in fp32 around the mean."""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)


class Standardize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        mean = x.mean(dim=-1, keepdim=True)
        var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
        return ((x - mean) / torch.sqrt(var + 1e-5)).to(dtype)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.standardize = Standardize()
        self.head = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.standardize(self.proj(x)))


readings = 10.0 * torch.randn(64, 16)
labels = (readings[:, 0] > 0).long()
model = Net().to(device)
with torch.no_grad():
    model.proj.bias.fill_(300.0)  # sensor offset learnt by a previous run
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(4):
    x, y = readings[step * 16:(step + 1) * 16].to(device), labels[step * 16:(step + 1) * 16].to(device)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
