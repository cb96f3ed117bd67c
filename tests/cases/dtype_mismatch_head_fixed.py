"""Fixed variant of dtype_mismatch_head.py: the projections and the loss run inside the autocast block."""
import torch
from torch import nn
from torch.nn import functional as F

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)


class DualEncoder(nn.Module):
    def __init__(self, d: int = 32, joint: int = 16) -> None:
        super().__init__()
        self.image_encoder = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, d), nn.GELU(), nn.Linear(d, d))
        self.text_encoder = nn.Sequential(nn.EmbeddingBag(100, d), nn.Linear(d, d))
        self.image_proj = nn.Linear(d, joint)
        self.text_proj = nn.Linear(d, joint)


model = DualEncoder().to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler(device)
images, captions = torch.randn(32, 3, 8, 8), torch.randint(0, 100, (32, 6))
for step in range(4):
    img, txt = images[step * 8:(step + 1) * 8].to(device), captions[step * 8:(step + 1) * 8].to(device)
    with torch.autocast(device_type=device, dtype=torch.float16):
        img_feat = model.image_encoder(img)
        txt_feat = model.text_encoder(txt)
        img_emb = F.normalize(model.image_proj(img_feat), dim=-1)
        txt_emb = F.normalize(model.text_proj(txt_feat), dim=-1)
        logits = img_emb.float() @ txt_emb.float().T / 0.07
        target = torch.arange(len(img), device=device)
        loss = (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
