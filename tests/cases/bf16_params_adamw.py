"""A small language model cast to bf16 (model.to(torch.bfloat16)) and trained with AdamW.

"bf16 needs no loss scaling", so the script converts the whole model.  But then the weights
themselves are bf16: with 8 significant bits, an update smaller than 1/256 of a weight rounds
away, so most of AdamW's small steps are lost.
"""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
VOCAB = 32
text = torch.randint(0, VOCAB, (64, 9))
model = nn.Sequential(nn.Embedding(VOCAB, 32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, VOCAB))
model = model.to(device=device, dtype=torch.bfloat16)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(6):
    batch = text[step * 8:(step + 1) * 8].to(device)
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
