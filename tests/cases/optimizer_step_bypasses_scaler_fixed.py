"""Fixed variant of optimizer_step_bypasses_scaler.py: scaler.step(optimizer) performs the step."""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)


class Recommender(nn.Module):
    def __init__(self, users: int = 50, items: int = 80, d: int = 16) -> None:
        super().__init__()
        self.users, self.items = nn.Embedding(users, d), nn.Embedding(items, d)
        self.mlp = nn.Sequential(nn.Linear(2 * d, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, u: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.users(u), self.items(i)], dim=-1)).squeeze(-1)


users, items = torch.randint(0, 50, (64,)), torch.randint(0, 80, (64,))
clicks = ((users + items) % 3 == 0).float()
model = Recommender().to(device)
optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)
scaler = torch.amp.GradScaler(device)
for step in range(4):
    sl = slice(step * 16, (step + 1) * 16)
    with torch.autocast(device_type=device, dtype=torch.float16):
        logits = model(users[sl].to(device), items[sl].to(device))
        loss = F.binary_cross_entropy_with_logits(logits, clicks[sl].to(device))
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
