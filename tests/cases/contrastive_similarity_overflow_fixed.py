"""The contrastive loss of ``contrastive_similarity_overflow.py`` on L2-normalised embeddings, with
the similarities computed in fp32: cosine similarities over a temperature stay far inside fp16's
range, and the loss is computed from fp32 values."""
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
encoder = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32))
optimizer = torch.optim.SGD(encoder.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
views = torch.randn(48, 16) * 300
for step in range(6):
    x = views[step * 8:(step + 1) * 8]
    with torch.autocast("cpu", dtype=torch.float16):
        z = encoder(x)
        z = F.normalize(z.float(), dim=-1)
        logits = z @ z.T / 0.1  # cosine similarities over a temperature, in fp32
        logits = logits - logits.max(dim=-1, keepdim=True).values
        loss = F.cross_entropy(logits.float(), torch.arange(8))
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
