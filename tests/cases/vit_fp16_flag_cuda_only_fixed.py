"""Fixed variant of vit_fp16_flag_cuda_only.py: --fp16 turns mixed precision on whatever the device
(fp16 autocast with a CPU GradScaler on a CPU-only machine)."""
import argparse

import torch
from torch import nn
from torch.nn import functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--fp16", action=argparse.BooleanOptionalAction, default=True, help="fp16 mixed precision")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--lr", type=float, default=1e-3)
args = parser.parse_args()

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
use_amp = args.fp16
torch.manual_seed(0)


class PatchEmbed(nn.Module):
    def __init__(self, patch=4, channels=3, dim=64):
        super().__init__()
        self.patch = patch
        self.proj = nn.Linear(patch * patch * channels, dim)

    def forward(self, x):
        B, C, H, W = x.shape
        p = self.patch
        x = x.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5).reshape(B, (H // p) * (W // p), -1)
        return self.proj(x)


class Block(nn.Module):
    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    def __init__(self, num_classes=4, dim=64, depth=2, num_patches=9):
        super().__init__()
        self.patch_embed = PatchEmbed(dim=dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, num_patches + 1, dim))
        self.blocks = nn.Sequential(*[Block(dim) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


def make_dataset(n=64):
    """Coloured 12x12 images: the class is the colour channel that holds a bright bar."""
    labels = torch.randint(0, 4, (n,))
    images = 0.1 * torch.randn(n, 3, 12, 12)
    for i, c in enumerate(labels.tolist()):
        images[i, c % 3, 4:8, :] += 1.0 if c < 3 else -1.0
    return images, labels


images, labels = make_dataset()
model = TinyViT().to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
scaler = torch.amp.GradScaler(device.type, enabled=use_amp)
for epoch in range(args.epochs):
    for i in range(0, len(images), 32):
        x, y = images[i:i + 32].to(device), labels[i:i + 32].to(device)
        with torch.autocast(device_type=device.type, dtype=torch.float16, enabled=use_amp):
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    print(f"epoch {epoch}: loss {loss.item():.4f} ({'fp16 mixed precision' if args.fp16 else 'fp32'})")
