"""Fixed variant of bf16_params_adamw.py: fp32 weights, bf16 autocast for the math."""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
VOCAB = 32
text = torch.randint(0, VOCAB, (64, 9))
model = nn.Sequential(nn.Embedding(VOCAB, 32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, VOCAB))
model = model.to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(6):
    batch = text[step * 8:(step + 1) * 8].to(device)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
