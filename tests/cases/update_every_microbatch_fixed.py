"""Fixed variant of update_every_microbatch.py: scaler.update() runs at the accumulation boundary only."""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
ACCUM = 4
torch.manual_seed(0)


class BagOfWords(nn.Module):
    def __init__(self, vocab: int = 200, d: int = 32, classes: int = 2) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(vocab, d, mode="mean")
        self.fc = nn.Linear(d, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc(self.embed(tokens))


docs = torch.randint(0, 200, (128, 20))
labels = (docs < 100).float().mean(1).gt(0.5).long()
model = BagOfWords().to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler(device)

for i in range(16):
    x, y = docs[i * 8:(i + 1) * 8].to(device), labels[i * 8:(i + 1) * 8].to(device)
    with torch.autocast(device_type=device, dtype=torch.float16):
        loss = F.cross_entropy(model(x), y) / ACCUM
    scaler.scale(loss).backward()
    if (i + 1) % ACCUM == 0:
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item() * ACCUM:.4f}")
